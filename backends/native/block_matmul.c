/* Y = A W^T for block-quantized W, as an onnxruntime custom op (domain
 * "hetero_sd.native", op "BlockMatMul"), taking MatMulNBits' own inputs.
 *
 * Why: MatMulNBits rounds a one-row call apart from a row of a wider call on hosts
 * where MLAS takes its one-row GEMV branch (4-bit blocks of 32-128), so the exact
 * target padded every one-token step to two rows (~12% of a 1.5B step). Here every
 * (row, column) runs the same integer dot products and the same float sums, in the
 * same order, whatever the call's width: a row rounds alike alone or in any verify,
 * by construction. Rows share each weight load (up to 4 rows a tile), so a verify
 * reads the weights once.
 *
 * Numerics (as llama.cpp's vec_dot and MLAS's accuracy level 4): each row of A is
 * quantized to int8 per weight block (scale amax / 127, rounded to nearest even);
 * a block's integer dot product, less its zero point times the row's block sum, is
 * exact; the float sum over blocks runs in block order, per lane, then one fixed
 * horizontal sum.
 *
 * Inputs:  A [..., K] float, B [N, K / block, block * bits / 8] uint8 (MatMulNBits'
 *          packing: 4-bit even elements in the low nibble), scales [N * K / block]
 *          float, zero_points (optional) uint8 [N, ceil(K / block * bits / 8)]
 *          (default 8 for 4-bit, 128 for 8-bit). (A GGUF file's own blocks, minimums
 *          included, go to GGUFMatMul: gguf_matmul.c.)
 * Output:  Y [..., N] float.
 * Attributes: K, N, bits (4 or 8), block_size (32, 64, 128 or 256); K % 64 == 0.
 */
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "block_simd.h"
#include "ort_api.h"

/* A step is what one pass of dot products covers: 4-bit, 8 VL elements (4 VL bytes,
 * the low nibbles the even elements, the high the odd); 8-bit, 4 VL elements. A row of
 * A is stored per step as the weights unpack: 4-bit [even | odd], 8-bit in order. With
 * AVX-512, a 4-bit K that 128 does not divide ends in a half step of 64. Lane l of a
 * step's dot products covers elements from lane_elem(l) on, all in one block. */
enum { COLS_PER_TASK = 32, ROWS_PER_TASK = 64, PAD = 128 };
/* how far ahead of a column's step the weights are fetched: a column (768 bytes on a
 * 1.5B) is too short a stream for the hardware prefetcher to find in time, and the
 * columns lie end to end, so an address this far on is one the walk reaches soon.
 * Measured on a 2-core AMD EPYC with ~100 MB of weights: a one-row call 1.3-1.5x
 * faster than without. */
enum { PREFETCH = 12288 };

typedef struct {
  const uint8_t *w, *zp;
  const float* s;  /* scales */
  const int8_t* qa;   /* [M, qstride] */
  const float* dexp;  /* [M, steps, dlanes]: each lane's activation scale (one for all, where a step
                      * lies in one block) */
  const float* g;     /* [M, kbp]: activation scale x integer sum, per block (0-padded) */
  float* y;
  int64_t M, N, K;
  int B, bits, kb, kbp, zstride, steps, S, qstride, col_tasks, zcorr, dlanes;
  size_t zbytes;  /* the zero points' size */
  float zdefault, zbase;  /* zero point where none is given; what the dot product applied already */
  int32_t rel_main[VL], rel_tail[VL];  /* lane -> block, from the step's first block */
  int nb_main, nb_tail;                /* blocks a step touches */
} Job;

static inline int lane_elem(int bits, int l) { return bits == 4 ? 8 * l : 4 * l; }
static inline int step_half(const Job* j, int st) { return st + j->S > j->K ? 32 : j->S / 2; }

/* ---- activations: a row quantized to int8 per block (scale amax / 127) ----------- */

static void quantize_row(const Job* j, const float* a, int8_t* q, float* dexp, float* g, float* d) {
  const int K = (int)j->K, B = j->B, kb = j->kb;
  for (int b = 0; b < kb; b++) {
    fvec m = fzero();
    for (int i = 0; i < B; i += VL) m = FMAX(m, fabsv(fload(a + b * B + i)));
    d[b] = fmaxh(m) / 127.0f;
  }
  for (int b = 0; b < kb; b++) {
    const fvec inv = SET1(d[b] > 0.0f ? 1.0f / d[b] : 0.0f);
    ivec sum = izero();
    for (int k = b * B; k < (b + 1) * B; k += 2 * VL) {
      if (j->bits == 8) {
        const ivec q0 = ROUND(MUL(fload(a + k), inv)), q1 = ROUND(MUL(fload(a + k + VL), inv));
        store_i8(q + k, q0);
        store_i8(q + k + VL, q1);
        sum = IADD(sum, IADD(q0, q1));
      } else {
        const int st = k / j->S * j->S, h = step_half(j, st);
        fvec e, o;
        evens_odds(a + k, &e, &o);
        const ivec qe = ROUND(MUL(e, inv)), qo = ROUND(MUL(o, inv));
        store_i8(q + st + (k - st) / 2, qe);
        store_i8(q + st + h + (k - st) / 2, qo);
        sum = IADD(sum, IADD(qe, qo));
      }
    }
    g[b] = d[b] * (float)isum(sum);
  }
  for (int b = kb; b < j->kbp; b++) g[b] = 0.0f;
  for (int i = 0; i < j->steps; i++) {
    const int st = i * j->S, tail = st + j->S > K;
    if (j->dlanes == 1) {
      dexp[i] = d[st / B];
      continue;
    }
    for (int l = 0; l < VL; l++) {
      const int e = lane_elem(j->bits, l);
      dexp[i * VL + l] = tail && e >= 64 ? 0.0f : d[(st + e) / B];
    }
  }
}

typedef struct { const Job* j; const float* a; int8_t* qa; float *dexp, *g, *d; } Quant;

static void quantize_task(void* arg, size_t m) {
  const Quant* q = (const Quant*)arg;
  const Job* j = q->j;
  int8_t* row = q->qa + m * j->qstride;
  quantize_row(j, q->a + m * j->K, row, q->dexp + m * j->steps * j->dlanes, q->g + m * j->kbp, q->d + m * j->kb);
  memset(row + j->K, 0, PAD);  /* a tail step reads past K (against zero weights): no stale bytes there */
}


/* ---- a tile: mr rows against nc columns -----------------------------------------
 * Every (row, column) pair runs the same dot products and float operations in the
 * same order whatever mr and nc are: the tile only decides which loads are shared. */
enum { MR = 4 };

typedef struct {      /* where a tile's walk over K stands */
  const uint8_t* w[4];  /* each column's weights at the step */
  const float* s[4];    /* each column's scales, from its first block */
  const int8_t* a[MR];  /* each row's quantized activations at the step */
  const float* d[MR];   /* each row's lane scales at the step */
} Walk;

/* one step; `tail`: the half step that ends a 4-bit K 128 does not divide; `one_block`:
 * the step lies in one block, so its weight scale is a broadcast (the value lanes()
 * would give every lane) */
static inline __attribute__((always_inline)) void step(const Job* j, fvec acc[][4], Walk* at, const int mr,
    const int nc, const int bits, int b0, const int tail, const int one_block) {
  ivec wl[4], wh[4];
  fvec sc[4];
#pragma GCC unroll 4
  for (int c = 0; c < nc; c++) {
    _mm_prefetch((const char*)at->w[c] + PREFETCH, _MM_HINT_T0);
    if (bits == 4) load4(at->w[c], tail, &wl[c], &wh[c]);
    else wl[c] = load8(at->w[c]);
    at->w[c] += j->S * bits / 8;
    if (!one_block) sc[c] = lanes(at->s[c] + b0, tail ? j->nb_tail : j->nb_main, tail ? j->rel_tail : j->rel_main);
  }
  const int h = bits == 4 ? (tail ? 32 : j->S / 2) : 0;
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    const int8_t* a = at->a[r];
    const float d0 = at->d[r][0];  /* a one-block step's */
    const fvec dr = one_block ? SET1(d0) : fload(at->d[r]);
    at->a[r] += j->S;
    at->d[r] += one_block ? 1 : VL;
#pragma GCC unroll 4
    for (int c = 0; c < nc; c++) {
      const ivec t = bits == 4 ? dot(dot(izero(), wl[c], a), wh[c], a + h) : dot8(izero(), wl[c], a);
      /* one block: one scale a lane, the product of two scalars (a vector multiply fewer) */
      acc[r][c] = one_block ? FMA(CVT(t), SET1(at->s[c][b0] * d0), acc[r][c])
                            : FMA(MUL(CVT(t), dr), sc[c], acc[r][c]);
    }
  }
}

static inline __attribute__((always_inline)) void tile(const Job* j, int64_t m0, const int mr, int64_t n0,
                                                       const int nc, const int bits) {
  const int K = (int)j->K, S = j->S, kb = j->kb, full = K / S;
  fvec acc[MR][4];
  Walk at;
#pragma GCC unroll 4
  for (int c = 0; c < nc; c++) {
    at.w[c] = j->w + (size_t)(n0 + c) * K * bits / 8;
    at.s[c] = j->s + (size_t)(n0 + c) * kb;
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++) {
    at.a[r] = j->qa + (size_t)(m0 + r) * j->qstride;
    at.d[r] = j->dexp + (size_t)(m0 + r) * j->steps * j->dlanes;
#pragma GCC unroll 4
    for (int c = 0; c < nc; c++) acc[r][c] = fzero();
  }
  if (S <= j->B)
    for (int i = 0; i < full; i++) step(j, acc, &at, mr, nc, bits, i * S / j->B, 0, 1);
  else
    for (int i = 0; i < full; i++) step(j, acc, &at, mr, nc, bits, i * S / j->B, 0, 0);
  if (full < j->steps) step(j, acc, &at, mr, nc, bits, full * S / j->B, 1, 0);
  if (j->zcorr) {  /* less zero point x scale x the block's integer sum, VL blocks at a time */
    for (int b = 0; b < kb; b += VL) {
      const int n = kb - b < VL ? kb - b : VL;
      fvec sz[4];
#pragma GCC unroll 4
      for (int c = 0; c < nc; c++) {
        const size_t at = (size_t)(n0 + c) * j->zstride + (bits == 4 ? b / 2 : b);
        const fvec z = j->zp ? zeros_of(j->zp + at, bits, n, at + 16 <= j->zbytes) : SET1(j->zdefault);
        sz[c] = MUL(floadn(j->s + (size_t)(n0 + c) * kb + b, n), SUB(z, SET1(j->zbase)));
      }
#pragma GCC unroll 4
      for (int r = 0; r < mr; r++) {
        const fvec gr = fload(j->g + (size_t)(m0 + r) * j->kbp + b);
#pragma GCC unroll 4
        for (int c = 0; c < nc; c++) acc[r][c] = FNMA(sz[c], gr, acc[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
    for (int c = 0; c < nc; c++) j->y[(size_t)(m0 + r) * j->N + n0 + c] = fsum(acc[r][c]);
}

/* rows m0.. (mr of them) against columns [n0, n1): nc columns a tile as registers allow */
static inline __attribute__((always_inline)) void row_tile(const Job* j, int64_t m0, const int mr, int64_t n0,
                                                           int64_t n1, const int bits) {
  const int nc = mr <= 2 || bits == 4 ? 4 : 3;  /* (measured: 8-bit's wider tile spills) */
  int64_t n = n0;
  if (nc == 4) for (; n + 4 <= n1; n += 4) tile(j, m0, mr, n, 4, bits);
  else for (; n + 3 <= n1; n += 3) tile(j, m0, mr, n, 3, bits);
  for (; n < n1; n++) tile(j, m0, mr, n, 1, bits);
}

static inline __attribute__((always_inline)) void rows(const Job* j, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                                                       const int bits) {
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) row_tile(j, m, MR, n0, n1, bits);
  switch (m1 - m) {
    case 3: row_tile(j, m, 3, n0, n1, bits); break;
    case 2: row_tile(j, m, 2, n0, n1, bits); break;
    case 1: row_tile(j, m, 1, n0, n1, bits); break;
    default: break;
  }
}

static void task(void* arg, size_t t) {
  const Job* j = (const Job*)arg;
  const int64_t n0 = (int64_t)(t % j->col_tasks) * COLS_PER_TASK, n1 = n0 + COLS_PER_TASK < j->N ? n0 + COLS_PER_TASK : j->N;
  const int64_t m0 = (int64_t)(t / j->col_tasks) * ROWS_PER_TASK, m1 = m0 + ROWS_PER_TASK < j->M ? m0 + ROWS_PER_TASK : j->M;
  if (j->bits == 4) rows(j, m0, m1, n0, n1, 4);
  else rows(j, m0, m1, n0, n1, 8);
}

/* ---- the onnxruntime kernel ------------------------------------------------------ */

typedef struct { const OrtApi* api; int64_t K, N, bits, block; } Kernel;

void* matmul_scratch(size_t bytes) {  /* kept across calls (see slab_attention.c); gguf_matmul.c's too */
  static __thread void* buf = NULL;
  static __thread size_t cap = 0;
  if (bytes > cap) {
    free(buf);
    cap = bytes + bytes / 2;
    buf = aligned_alloc(64, (cap + 63) & ~(size_t)63);
    if (!buf) cap = 0;
  }
  return buf;
}

static OrtStatus* compute(void* self, OrtKernelContext* ctx) {
  const Kernel* kn = (const Kernel*)self;
  const OrtApi* api = kn->api;
  size_t count;
  TRY(api->KernelContext_GetInputCount(ctx, &count));
  const OrtValue* in[4] = {NULL, NULL, NULL, NULL};
  for (size_t i = 0; i < count && i < 4; i++) TRY(api->KernelContext_GetInput(ctx, i, &in[i]));
  int64_t ad[4], bd[4];
  size_t na, nb;
  TRY(dims(api, in[0], ad, &na));
  TRY(dims(api, in[1], bd, &nb));
  const int64_t K = kn->K, N = kn->N, B = kn->block, kb = K / B;
  if (na < 1 || ad[na - 1] != K || nb != 3 || bd[0] != N || bd[1] != kb || bd[2] != B * kn->bits / 8)
    return api->CreateStatus(ORT_INVALID_ARGUMENT, "BlockMatMul: A [..., K], B [N, K / block, block * bits / 8]");
  int64_t M = 1, yd[4];
  for (size_t i = 0; i + 1 < na; i++) { M *= ad[i]; yd[i] = ad[i]; }
  yd[na - 1] = N;
  void *pa, *pb, *ps, *pz = NULL;
  TRY(api->GetTensorMutableData((OrtValue*)in[0], &pa));
  TRY(api->GetTensorMutableData((OrtValue*)in[1], &pb));
  TRY(api->GetTensorMutableData((OrtValue*)in[2], &ps));
  if (in[3]) TRY(api->GetTensorMutableData((OrtValue*)in[3], &pz));
  {
    int64_t sd[4], total = 1;
    size_t ns;
    TRY(dims(api, in[2], sd, &ns));
    for (size_t i = 0; i < ns; i++) total *= sd[i];
    if (total != N * kb) return api->CreateStatus(ORT_INVALID_ARGUMENT, "BlockMatMul: scales [N * K / block]");
  }
  if (in[3]) {
    int64_t zd[4];
    size_t nz;
    TRY(dims(api, in[3], zd, &nz));
    int64_t total = 1;
    for (size_t i = 0; i < nz; i++) total *= zd[i];
    if (total != N * ((kb * kn->bits + 7) / 8))
      return api->CreateStatus(ORT_INVALID_ARGUMENT, "BlockMatMul: zero_points [N, ceil(K / block * bits / 8)]");
  }
  OrtValue* out;
  TRY(api->KernelContext_GetOutput(ctx, 0, yd, na, &out));
  void* py;
  TRY(api->GetTensorMutableData(out, &py));
  if (M == 0) return NULL;
  Job j = {.w = (const uint8_t*)pb, .zp = (const uint8_t*)pz, .s = (const float*)ps,
           .y = (float*)py,
           .M = M, .N = N, .K = K, .B = (int)B, .bits = (int)kn->bits, .kb = (int)kb};
  j.S = j.bits == 4 ? 8 * VL : 4 * VL;
  j.steps = (int)((K + j.S - 1) / j.S);
  j.dlanes = j.S <= j.B ? 1 : VL;  /* (then K % S == 0: no tail step) */
  j.kbp = (j.kb + VL - 1) / VL * VL;
  j.zstride = (int)((kb * kn->bits + 7) / 8);
  j.zbytes = (size_t)N * j.zstride;
  j.qstride = (int)K + PAD;
  j.col_tasks = (int)((N + COLS_PER_TASK - 1) / COLS_PER_TASK);
  j.zdefault = j.bits == 4 ? 8.0f : 128.0f;
  j.zbase = !WIDE && j.bits == 8 ? 128.0f : 0.0f;
  j.zcorr = pz || j.zdefault != j.zbase;
  for (int l = 0; l < VL; l++) {
    const int e = lane_elem(j.bits, l);
    j.rel_main[l] = j.S > j.B ? e / j.B : 0;
    j.rel_tail[l] = e < 64 && 64 > j.B ? e / j.B : 0;
  }
  j.nb_main = j.S > j.B ? j.S / j.B : 1;
  j.nb_tail = 64 > j.B ? 64 / j.B : 1;
  const size_t qbytes = ((size_t)M * j.qstride + 63) & ~(size_t)63;
  const size_t floats = (size_t)M * ((size_t)j.steps * VL + j.kbp + j.kb);
  int8_t* qa = (int8_t*)matmul_scratch(qbytes + floats * sizeof(float));
  if (!qa) return api->CreateStatus(ORT_FAIL, "BlockMatMul: out of memory for the quantized rows");
  float* dexp = (float*)(qa + qbytes);
  float* g = dexp + (size_t)M * j.steps * VL;
  float* d = g + (size_t)M * j.kbp;
  j.qa = qa; j.dexp = dexp; j.g = g;
  Quant qj = {&j, (const float*)pa, qa, dexp, g, d};
  return quantize_then_run(api, ctx, quantize_task, &qj, M, task, j.col_tasks, ROWS_PER_TASK, &j);
}

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return api->CreateStatus(ORT_FAIL, "BlockMatMul: out of memory");
  k->api = api;
  OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "K", &k->K);
  if (!st) st = api->KernelInfoGetAttribute_int64(info, "N", &k->N);
  if (!st) st = api->KernelInfoGetAttribute_int64(info, "bits", &k->bits);
  if (!st) st = api->KernelInfoGetAttribute_int64(info, "block_size", &k->block);
  if (!st && ((k->bits != 4 && k->bits != 8) || (k->block != 32 && k->block != 64 && k->block != 128 && k->block != 256)
              || k->K <= 0 || k->K % 64 || k->K % k->block || k->N <= 0))
    st = api->CreateStatus(ORT_INVALID_ARGUMENT, "BlockMatMul: bits 4 or 8, block_size 32/64/128/256, K a multiple of 64 and of the block");
  if (st) { free(k); return st; }
  *out = k;
  return NULL;
}

static const char* name(const OrtCustomOp* op) { (void)op; return "BlockMatMul"; }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 || i == 2 ? T_FLOAT : T_UINT8; }
static size_t inputs(const OrtCustomOp* op) { (void)op; return 4; }
static size_t outputs(const OrtCustomOp* op) { (void)op; return 1; }
static int in_kind(const OrtCustomOp* op, size_t i) { (void)op; return i >= 3 ? 1 : 0; }  /* zero points optional */

OrtCustomOp block_matmul_op = {
  .version = API_VERSION, .GetName = name, .GetExecutionProviderType = op_cpu,
  .GetInputType = input_type, .GetInputTypeCount = inputs, .GetOutputType = op_float,
  .GetOutputTypeCount = outputs, .KernelDestroy = op_free, .GetInputCharacteristic = in_kind,
  .GetOutputCharacteristic = op_required, .GetInputMemoryType = op_cpu_memory,
  .CreateKernelV2 = create, .KernelComputeV2 = compute,
};
