/* Y = A W^T for W in a GGUF file's own K-quant super-blocks (Q4_K, Q6_K), the bytes as
 * the file stores them, as an onnxruntime custom op (domain "hetero_sd.native", op
 * "GGUFMatMul").
 *
 * Why: as MatMulNBits' (or BlockMatMul's) blocks, a Q4_K_M model costs more bytes than
 * its file (a float scale per 32 or 16 values, Q6_K's 6 bits in an 8-bit container) and
 * Q4_K's minimums a side matmul; here a weight costs about the file's bits (Q6_K 6.63
 * against 6.56: padded for alignment; Q4_K 4.63 against 4.5: its 6-bit scales unpacked
 * to bytes), and the sub-block scales and minimums are
 * applied in integers, as llama.cpp's vec_dot does.
 *
 * Layout (backends/gguf_pack.py): the file's super-blocks with 8 columns interleaved,
 * each int32 lane one column's 4 consecutive values, so that one dot product against 4
 * broadcast activations serves 8 columns and a lane stays its column's to the output.
 * About half the instructions a weight of a column-at-a-time loop (llama.cpp repacks
 * its Q4_K alike).
 *
 * Numerics (llama.cpp's Q8_K activations): each row of A is quantized to int8 per
 * super-block of 256 (scale amax / 127, rounded to nearest even), with int16 sums per
 * 16 values. Within a super-block every product, sub-block scale, minimum and Q6_K's
 * offset of 32 is an exact integer sum per lane; its float part is two products in a
 * fixed order, and super-blocks are summed in order. Every (row, column) runs the same
 * operations whatever the call's width: a row rounds alike alone or inside any
 * verify, by construction. Rows share each weight load (up to 8 rows a tile).
 *
 * Inputs:  A [..., K] float, B [ceil(N / 8), K / 256, bytes] uint8 (a group's
 *          super-block: 1184 bytes for Q4_K, 1696 for Q6_K), bias (optional) [N] float.
 * Output:  Y [..., N] float: A W^T + bias.
 * Attributes: K (a multiple of 256), N, type (ggml's numbering: 12 Q4_K, 14 Q6_K),
 *          pairs (default 0: the step-pair layout B was packed in, which must be this
 *          build's PAIRS, gguf_blocks.h: 1 where it is AVX-512's), gated (default 0). Gated: B holds 2 ceil(N / 8) groups, a gate projection's
 *          group then an up projection's group of the same 8 columns (gguf_pack.py's
 *          pack_gated), and Y = silu(A G^T) * (A U^T): an MLP's gate, up and
 *          activation in one op, with no [.., 2N] tensor between (no bias).
 * Written with 256-bit AVX2, and for the dot products 512-bit AVX-512 VNNI where the
 * host has it (twice the products an instruction); where the host has only AVX-VNNI
 * its 256-bit dot product saves two instructions.
 */
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "ort_api.h"
#include "vec_math.h"
#include "gguf_blocks.h"

static inline int32_t hsum_i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* ---- activations: a row quantized to int8 per super-block (llama.cpp's Q8_K) or per block of 32 (its Q8_0) ---- */

/* n values (a multiple of 16) as int8 at scale amax / 127, rounded half to even: the
 * scale, and the sum of each 16 quantized values into s16 */
static float quantize_block(const float* a, int n, int8_t* q, int16_t* s16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(a + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float d = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))) / 127.0f;
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  for (int i = 0; i < n; i += 16) {
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + i), inv));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + i + 8), inv));
    s16[i / 16] = (int16_t)hsum_i(_mm256_add_epi32(q0, q1));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  /* in order */
    _mm_storeu_si128((__m128i*)(q + i), _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  }
  return d;
}

/* a row per super-block (K-quants), its sums of 16 and of 32 */
static void quantize_row(const Job* j, const float* a, int8_t* q, float* ad, int16_t* bs, int16_t* bs32) {
  for (int s = 0; s < j->nsb; s++, a += QK, q += QK, bs += QK / 16, bs32 += QK / 32) {
    ad[s] = quantize_block(a, QK, q, bs);
    for (int i = 0; i < QK / 32; i++) bs32[i] = (int16_t)(bs[2 * i] + bs[2 * i + 1]);
  }
}

/* the 32-value types' rows: per block of 32 (llama.cpp's Q8_0 activations), each
 * block's scale and sum */
static void quantize_row32(const Job* j, const float* a, int8_t* q, float* ad, int16_t* bs32) {
  for (int b = 0; b < j->nab; b++, a += QB, q += QB) {
    int16_t s16[2];
    ad[b] = quantize_block(a, QB, q, s16);
    bs32[b] = (int16_t)(s16[0] + s16[1]);
  }
}

typedef struct { const Job* j; const float* a; int8_t* qa; float* ad; int16_t *bs, *bs32; } Quant;

static void quantize_task(void* arg, size_t m) {
  const Quant* q = (const Quant*)arg;
  const Job* j = q->j;
  if (j->nab != j->nsb) {  /* the 32-value types: two activation blocks a unit */
    quantize_row32(j, q->a + m * j->K, q->qa + m * j->K, q->ad + m * j->nab, q->bs32 + m * (j->K / 32));
    return;
  }
  quantize_row(j, q->a + m * j->K, q->qa + m * j->K, q->ad + m * j->nsb, q->bs + m * (j->K / 16),
               q->bs32 + m * (j->K / 32));
}

/* silu(g) u = g u / (1 + e^-g) */
static inline __m256 swiglu(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(_mm256_mul_ps(g, u), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* group c's bias (a last group's padding columns 0) */
static inline __m256 bias_of(const Job* j, int64_t c) {
  float b[8] = {0};
  memcpy(b, j->bias + c * 8, (size_t)(j->N - c * 8 < 8 ? j->N - c * 8 : 8) * sizeof(float));
  return _mm256_loadu_ps(b);
}

static inline void store(const Job* j, int64_t m, int64_t n0, __m256 acc) {
  float* y = j->y + (size_t)m * j->N + n0;
  if (n0 + 8 <= j->N) { _mm256_storeu_ps(y, acc); return; }
  float t[8];  /* the last group's padding columns (zero blocks) are dropped */
  _mm256_storeu_ps(t, acc);
  memcpy(y, t, (size_t)(j->N - n0) * sizeof(float));
}

/* acc[r] = rows m0.. of A times group g's 8 columns */
static inline __attribute__((always_inline)) void tile(const Job* j, int64_t m0, const int mr, int64_t g, __m256* acc) {
  const int8_t* qa[MR];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    acc[r] = _mm256_setzero_ps();
    qa[r] = j->qa + (size_t)(m0 + r) * j->K;
  }
  switch (j->type) {  /* (each type its own inlined loop) */
    case TYPE_Q4_K: for (int s = 0; s < j->nsb; s++) q4k_block(j, m0, mr, g, s, qa, acc); break;
    case TYPE_Q6_K:
      for (int s = 0; s < j->nsb; s++) {
        if (mr <= NARROW) q6k_block_narrow(j, m0, mr, g, s, qa, acc);
        else q6k_block(j, m0, mr, g, s, qa, acc);
      }
      break;
    case TYPE_Q4_0: for (int u = 0; u < j->nsb; u++) legacy_unit(j, m0, mr, g, u, qa, acc, TYPE_Q4_0); break;
    case TYPE_Q4_1: for (int u = 0; u < j->nsb; u++) legacy_unit(j, m0, mr, g, u, qa, acc, TYPE_Q4_1); break;
    case TYPE_Q5_0: for (int u = 0; u < j->nsb; u++) legacy_unit(j, m0, mr, g, u, qa, acc, TYPE_Q5_0); break;
    case TYPE_Q5_1: for (int u = 0; u < j->nsb; u++) legacy_unit(j, m0, mr, g, u, qa, acc, TYPE_Q5_1); break;
    default: for (int u = 0; u < j->nsb; u++) legacy_unit(j, m0, mr, g, u, qa, acc, TYPE_Q8_0); break;
  }
}

/* rows m0.. of Y's columns 8c..: group c (+ bias), or gated, silu(group 2c) * group 2c + 1 */
static inline __attribute__((always_inline)) void out_tile(const Job* j, int64_t m0, const int mr, int64_t c) {
  __m256 acc[MR];
  if (j->gated) {
    __m256 up[MR];
    tile(j, m0, mr, 2 * c, acc);
    tile(j, m0, mr, 2 * c + 1, up);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) acc[r] = swiglu(acc[r], up[r]);
  } else {
    tile(j, m0, mr, c, acc);
    if (j->bias) {
      const __m256 bv = bias_of(j, c);
#pragma GCC unroll 8
      for (int r = 0; r < mr; r++) acc[r] = _mm256_add_ps(acc[r], bv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) store(j, m0 + r, c * 8, acc[r]);
}

/* rows m0 .. m1 - 1 of Y's column group c, MR rows a tile (Q4_K: MR_Q4K) */
static inline void rows(const Job* j, int64_t m0, int64_t m1, int64_t c) {
  int64_t m = m0;
  if (j->type == TYPE_Q4_K)
    for (; m + MR_Q4K <= m1; m += MR_Q4K) out_tile(j, m, MR_Q4K, c);
  else
    for (; m + MR <= m1; m += MR) out_tile(j, m, MR, c);
  switch (m1 - m) {  /* (each width its own inlined copy, its loops unrolled) */
#if MR_8
    case 7: out_tile(j, m, 7, c); break;
    case 6: out_tile(j, m, 6, c); break;
    case 5: out_tile(j, m, 5, c); break;
    case 4: out_tile(j, m, 4, c); break;
#endif
    case 3: out_tile(j, m, 3, c); break;
    case 2: out_tile(j, m, 2, c); break;
    case 1: out_tile(j, m, 1, c); break;
    default: break;
  }
}


/* a task: its groups of output columns one at a time, each against all its rows, MR at
 * a time, so a group's weights come from memory once and from the cache for the next rows */
static void task(void* arg, size_t t) {
  const Job* j = (const Job*)arg;
  const int64_t groups = (j->N + 7) / 8;  /* of Y's columns (gated: two of B's groups each) */
  const int64_t g0 = (int64_t)(t % j->col_tasks) * GROUPS_PER_TASK, g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
  const int64_t m0 = (int64_t)(t / j->col_tasks) * ROWS_PER_TASK, m1 = m0 + ROWS_PER_TASK < j->M ? m0 + ROWS_PER_TASK : j->M;
  for (int64_t g = g0; g < g1; g++) rows(j, m0, m1, g);
}

/* ---- the onnxruntime kernel ------------------------------------------------------ */

typedef struct { const OrtApi* api; int64_t K, N, type, gated, pairs; } Kernel;

/* the step-pair layout this build reads (gguf_blocks.h): the lowering asks it
 * (backends/native/__init__.py gguf_pairs) and packs the weights so */
__attribute__((visibility("default"))) int hetero_sd_gguf_pairs(void) { return PAIRS; }

static int kquant(int64_t type) { return type == TYPE_Q4_K || type == TYPE_Q6_K; }

/* B's units along K: super-blocks of 256, or two blocks of 32 (QU) */
static int64_t unit_values(int64_t type) { return kquant(type) ? QK : QU; }

static int64_t group_bytes(int64_t type) {
  return type == TYPE_Q4_K ? Q4K_GROUP : type == TYPE_Q6_K ? Q6K_GROUP : legacy_bytes((int)type);
}

static OrtStatus* compute(void* self, OrtKernelContext* ctx) {
  const Kernel* kn = (const Kernel*)self;
  const OrtApi* api = kn->api;
  const OrtValue *in_a, *in_b, *in_bias = NULL;
  size_t count;
  TRY(api->KernelContext_GetInputCount(ctx, &count));
  TRY(api->KernelContext_GetInput(ctx, 0, &in_a));
  TRY(api->KernelContext_GetInput(ctx, 1, &in_b));
  if (count > 2) TRY(api->KernelContext_GetInput(ctx, 2, &in_bias));
  int64_t ad[4], bd[4];
  size_t na, nb;
  TRY(dims(api, in_a, ad, &na));
  TRY(dims(api, in_b, bd, &nb));
  const int64_t K = kn->K, N = kn->N;
  if (na < 1 || ad[na - 1] != K || nb != 3 || bd[0] != (kn->gated ? 2 : 1) * ((N + 7) / 8)
      || bd[1] != K / unit_values(kn->type) || bd[2] != group_bytes(kn->type))
    return api->CreateStatus(ORT_INVALID_ARGUMENT, kn->gated
                             ? "GGUFMatMul: A [..., K], B [2 ceil(N / 8), K / (256 or 64), bytes a group's unit] (gated)"
                             : "GGUFMatMul: A [..., K], B [ceil(N / 8), K / (256 or 64), bytes a group's unit]");
  void* pbias = NULL;
  if (in_bias) {
    int64_t cd[4];
    size_t nc;
    TRY(dims(api, in_bias, cd, &nc));
    if (kn->gated || nc != 1 || cd[0] != N)
      return api->CreateStatus(ORT_INVALID_ARGUMENT, "GGUFMatMul: bias [N], not with gated");
    TRY(api->GetTensorMutableData((OrtValue*)in_bias, &pbias));
  }
  int64_t M = 1, yd[4];
  for (size_t i = 0; i + 1 < na; i++) { M *= ad[i]; yd[i] = ad[i]; }
  yd[na - 1] = N;
  void *pa, *pb, *py;
  TRY(api->GetTensorMutableData((OrtValue*)in_a, &pa));
  TRY(api->GetTensorMutableData((OrtValue*)in_b, &pb));
  OrtValue* out;
  TRY(api->KernelContext_GetOutput(ctx, 0, yd, na, &out));
  TRY(api->GetTensorMutableData(out, &py));
  if (M == 0) return NULL;
  /* nsb: B's units a row (super-blocks, or pairs of 32-value blocks); nab: activation blocks */
  Job j = {.w = (const uint8_t*)pb, .bias = (const float*)pbias, .y = (float*)py, .M = M, .N = N, .K = K,
           .type = (int)kn->type, .nsb = (int)(K / unit_values(kn->type)), .gated = (int)kn->gated,
           .nab = (int)(kquant(kn->type) ? K / QK : K / QB)};
  j.col_tasks = (int)(((N + 7) / 8 + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK);
  const size_t qbytes = ((size_t)M * K + 63) & ~(size_t)63, fbytes = ((size_t)M * j.nab * 4 + 63) & ~(size_t)63;
  int8_t* qa = (int8_t*)matmul_scratch(qbytes + fbytes + (size_t)M * (K / 16 + K / 32) * 2);
  if (!qa) return api->CreateStatus(ORT_FAIL, "GGUFMatMul: out of memory for the quantized rows");
  j.qa = qa;
  j.ad = (const float*)(qa + qbytes);
  j.bs = (const int16_t*)(qa + qbytes + fbytes);
  j.bs32 = j.bs + (size_t)M * (K / 16);
  Quant qj = {&j, (const float*)pa, qa, (float*)j.ad, (int16_t*)j.bs, (int16_t*)j.bs32};
  return quantize_then_run(api, ctx, quantize_task, &qj, M, task, j.col_tasks, ROWS_PER_TASK, &j);
}

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return api->CreateStatus(ORT_FAIL, "GGUFMatMul: out of memory");
  k->api = api;
  OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "K", &k->K);
  if (!st) st = api->KernelInfoGetAttribute_int64(info, "N", &k->N);
  if (!st) st = api->KernelInfoGetAttribute_int64(info, "type", &k->type);
  if (!st) {
    OrtStatus* none = api->KernelInfoGetAttribute_int64(info, "gated", &k->gated);
    if (none) { api->ReleaseStatus(none); k->gated = 0; }  /* (optional: default 0) */
    none = api->KernelInfoGetAttribute_int64(info, "pairs", &k->pairs);
    if (none) { api->ReleaseStatus(none); k->pairs = 0; }  /* (optional: default 0) */
  }
  const int known = kquant(k->type) || k->type == TYPE_Q4_0 || k->type == TYPE_Q4_1 || k->type == TYPE_Q5_0
                    || k->type == TYPE_Q5_1 || k->type == TYPE_Q8_0;
  if (!st && (!known || k->K <= 0 || k->K % unit_values(k->type) || k->N <= 0))
    st = api->CreateStatus(ORT_INVALID_ARGUMENT, "GGUFMatMul: type 12 (Q4_K) or 14 (Q6_K) with K a multiple of 256, "
                                                 "or 2, 3, 6, 7, 8 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with K a multiple of 64");
  if (!st && k->pairs != PAIRS)
    st = api->CreateStatus(ORT_INVALID_ARGUMENT, PAIRS
        ? "GGUFMatMul: weights packed for the AVX2 build (pairs 0); this build is AVX-512's (pairs 1): "
          "lower the graph on this host again"
        : "GGUFMatMul: weights packed for the AVX-512 build (pairs 1); this build is AVX2's (pairs 0): "
          "lower the graph on this host again");
  if (st) { free(k); return st; }
  *out = k;
  return NULL;
}

static const char* name(const OrtCustomOp* op) { (void)op; return "GGUFMatMul"; }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 1 ? T_UINT8 : T_FLOAT; }
static size_t inputs(const OrtCustomOp* op) { (void)op; return 3; }
static int in_kind(const OrtCustomOp* op, size_t i) { (void)op; return i == 2 ? 1 : 0; }  /* the bias optional */
static size_t outputs(const OrtCustomOp* op) { (void)op; return 1; }

OrtCustomOp gguf_matmul_op = {
  .version = API_VERSION, .GetName = name, .GetExecutionProviderType = op_cpu,
  .GetInputType = input_type, .GetInputTypeCount = inputs, .GetOutputType = op_float,
  .GetOutputTypeCount = outputs, .KernelDestroy = op_free, .GetInputCharacteristic = in_kind,
  .GetOutputCharacteristic = op_required, .GetInputMemoryType = op_cpu_memory,
  .CreateKernelV2 = create, .KernelComputeV2 = compute,
};
