/* Attention over the KV pool, one query row at a time, as an onnxruntime custom op
 * (domain "hetero_sd.native", op "SlabAttention"), for every sequence of a call.
 *
 * Why: onnxruntime's GroupQueryAttention rounds a one-row call apart from a row of a
 * longer call (its one-row GEMM path), and on a CPU it costs ~0.45 us per cached
 * position per layer on the 1.5B (3x its memory bound). Here every (row, head) runs
 * the same loop over its own sequence's positions in a fixed order whatever the call
 * holds: a row rounds alike alone, inside any verify and inside any batch of
 * sequences (varlen, as flash-attention's varlen API packs them), by construction,
 * and reads its sequence's slab once per KV head.
 *
 * Inputs:  qkv [T, (H + 2 Hkv) D] float: every sequence's rows, packed in order;
 *          pool float [N]: the runner's whole KV pool, WRITTEN IN PLACE (the new rows'
 *          K and V; the runner binds its own memory, so nothing is copied);
 *          seqs int64 [B, 5]: per sequence (first row in qkv, rows, past length,
 *          reserved positions R, offset in the pool of its slab [2, layers, Hkv, R, D]);
 *          cos / sin [P, rd / 2] float (RoPE tables, rotate-half; ignored when rotary = 0).
 * Output:  out [T, H D].
 * Attributes: num_heads, kv_num_heads, head_dim, layer, num_layers, rotary (0/1),
 *          scale, window (0: none; else a row sees its last `window` positions),
 *          softcap (0: none; else scores become softcap * tanh(score / softcap)).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "ort_api.h"
#include "vec_math.h"

enum { T_INT64 = 7, SEQ_FIELDS = 5 };

/* ---- the numerics: one (row, head) at a time ---------------------------------- */

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float dot(const float* a, const float* b, int D) {  /* D % 16 == 0 */
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  return hsum8(_mm256_add_ps(s0, s1));
}

/* dot(q, k_i) for the 4 slab rows k_0..k_3 (D apart), each summed exactly as dot()
 * sums it: 8 independent chains keep both FMA units busy where one dot's 2 chains
 * wait on their own latency */
static inline void dot4(const float* q, const float* k, int D, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
  for (int d = 0; d < D; d += 16) {
    const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + 8);
    a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + d + 8), a1);
    b0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + D + d), b0);
    b1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + D + d + 8), b1);
    c0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + 2 * D + d), c0);
    c1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + 2 * D + d + 8), c1);
    d0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + 3 * D + d), d0);
    d1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + 3 * D + d + 8), d1);
  }
  out[0] = hsum8(_mm256_add_ps(a0, a1));
  out[1] = hsum8(_mm256_add_ps(b0, b1));
  out[2] = hsum8(_mm256_add_ps(c0, c1));
  out[3] = hsum8(_mm256_add_ps(d0, d1));
}

/* rotate-half RoPE of x[D] at one position (cos/sin rows of half = rd / 2) */
static void rope(const float* x, float* y, int D, const float* cos, const float* sin, int half) {
  memcpy(y, x, sizeof(float) * D);
  if (!cos) return;
  for (int i = 0; i < half; i++) {
    float a = x[i], b = x[i + half], c = cos[i], s = sin[i];
    y[i] = a * c - b * s;
    y[i + half] = b * c + a * s;
  }
}

typedef struct {
  int H, Hkv, D, half;
  float scale, cap;  /* cap: the soft-cap, 0 for none */
  int64_t window;  /* 0: every past position; else the last `window` */
  const float *qkv, *cos, *sin;  /* qkv: the sequence's first row */
  float *k, *v, *out;  /* the layer's slabs [Hkv, R, D]; out: the sequence's first row [T, H D] */
  int64_t R, past, T;
  int* failed;  /* set (atomically) by a task that could not get its scratch memory */
} Job;

/* a call's sequences: task t belongs to job b where first[b] <= t < first[b + 1] */
typedef struct { const Job* jobs; const size_t* first; int64_t B; } Jobs;

/* acc[b] += sum_i w[b][i] V[i] over the block's positions i0 <= i < min(i1, n[b]), in
 * position order, for pn pairs (acc [pn, D]). A block of V (IB rows, 16 KB at D = 128)
 * stays in L1 across the D / 8 lane passes (measured alone, level with passes down
 * the whole slab). The loops over pairs are unrolled so a[] lives in registers: left
 * to -O2 they were not, and every FMA loaded and stored its accumulator (the sum took
 * 2.5x the scores' time; unrolled, a 9-row call of the 1.5B's shapes 1.7x faster). */
static inline __attribute__((always_inline)) void weigh(const float* V, int D, const float* w, int64_t stride,
    int64_t i0, int64_t i1, int64_t lo, const int64_t* n, float* acc, const int pn) {
  const int64_t shared = lo < i1 ? lo : i1;  /* positions every pair here sees */
  for (int d = 0; d < D; d += 8) {
    __m256 a[8];
    _Pragma("GCC unroll 8") for (int b = 0; b < pn; b++) a[b] = _mm256_loadu_ps(acc + (size_t)b * D + d);
    for (int64_t i = i0; i < shared; i++) {
      const __m256 vv = _mm256_loadu_ps(V + i * D + d);
      _Pragma("GCC unroll 8") for (int b = 0; b < pn; b++) a[b] = _mm256_fmadd_ps(_mm256_set1_ps(w[b * stride + i]), vv, a[b]);
    }
    _Pragma("GCC unroll 8") for (int b = 0; b < pn; b++) {  /* then each pair's own last positions, in order */
      const int64_t e = n[b] < i1 ? n[b] : i1;
      for (int64_t i = shared > i0 ? shared : i0; i < e; i++)
        a[b] = _mm256_fmadd_ps(_mm256_set1_ps(w[b * stride + i]), _mm256_loadu_ps(V + i * D + d), a[b]);
    }
    _Pragma("GCC unroll 8") for (int b = 0; b < pn; b++) _mm256_storeu_ps(acc + (size_t)b * D + d, a[b]);
  }
}

/* A per-thread buffer kept across calls: a fresh malloc of a long context's scores
 * (past glibc's mmap threshold) would map and unmap pages on every call. */
static float* scratch(size_t floats) {
  static __thread float* buf = NULL;
  static __thread size_t cap = 0;
  if (floats > cap) {
    free(buf);
    cap = floats + floats / 2;
    buf = (float*)malloc(sizeof(float) * cap);
    if (!buf) cap = 0;
  }
  return buf;
}

/* Up to ROWS query rows of one call against one KV head, for the G = H / Hkv query
 * heads that share it: each slab row is read once for all of them. Every (row, head)
 * pair still runs its own scores, softmax and weighted sum over its own positions
 * 0..n-1 in order, exactly as it would alone: the result does not depend on T. */
/* IB: positions a block (scores and weighted sum alike) */
enum { ROWS = 4, MAXPAIRS = 64 * ROWS, IB = 32 };

static void attend_one(const Job* j, size_t task) {
  /* a KV head's row blocks are consecutive tasks: onnxruntime hands each thread a run
   * of tasks, so with two KV heads on two threads each takes one head's rows */
  const int64_t blocks = (j->T + ROWS - 1) / ROWS;
  const int H = j->H, Hkv = j->Hkv, D = j->D, G = H / Hkv, g = (int)(task / blocks);
  const int64_t t0 = (int64_t)(task % blocks) * ROWS;
  const int rows = (int)(j->T - t0 < ROWS ? j->T - t0 : ROWS), P = rows * G;
  const int64_t nmax = j->past + t0 + rows, stride = (nmax + 7) & ~(int64_t)7;
  const float* K = j->k + ((size_t)g * j->R) * D;
  const float* V = j->v + ((size_t)g * j->R) * D;
  const int width = (H + 2 * Hkv) * D;
  float* q = scratch((size_t)P * D + (size_t)P * stride);
  if (!q) { __atomic_store_n(j->failed, 1, __ATOMIC_RELAXED); return; }
  float* s = q + (size_t)P * D;  /* pair p = r * G + a: scores, then weights [P, stride] */
  float acc_out[8 * 512];
  int64_t n[MAXPAIRS];
  for (int r = 0; r < rows; r++) {
    const int64_t pos = j->past + t0 + r;
    for (int a = 0; a < G; a++) {
      n[r * G + a] = pos + 1;
      rope(j->qkv + (size_t)(t0 + r) * width + (size_t)(g * G + a) * D, q + (size_t)(r * G + a) * D, D,
           j->cos ? j->cos + pos * j->half : NULL, j->sin ? j->sin + pos * j->half : NULL, j->half);
    }
  }
  /* scores in blocks of IB positions (16 KB of K at D = 128: L1 holds a block while
   * every pair reads it), 4 positions a dot4; fma(q, k) is fma(k, q), so each score
   * is the one dot() gives, whatever the blocking */
  for (int64_t i0 = 0; i0 < nmax; i0 += IB) {
    int p = 0;
    while (p < P && n[p] <= i0) p += G;  /* rows whose positions end before the block */
    for (; p < P; p++) {
      const float* qp = q + (size_t)p * D;
      float* sp = s + (size_t)p * stride;
      const int64_t e = n[p] < i0 + IB ? n[p] : i0 + IB;
      int64_t i = i0;
      for (; i + 4 <= e; i += 4) {
        float d4[4];
        dot4(qp, K + i * D, D, d4);
        for (int r = 0; r < 4; r++) sp[i + r] = d4[r] * j->scale;
      }
      for (; i < e; i++) sp[i] = dot(qp, K + i * D, D) * j->scale;
    }
  }
  float inv[MAXPAIRS];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int p = 0; p < P; p++) {
    float* sp = s + (size_t)p * stride;
    const int64_t np = n[p], n8 = (np + 7) & ~(int64_t)7;
    /* a window's earlier positions weigh exact zeros (their fma adds nothing) */
    const int64_t first = j->window && np > j->window ? np - j->window : 0;
    if (j->cap != 0.0f)
      for (int64_t i = first; i < np; i++) sp[i] = j->cap * tanhf(sp[i] / j->cap);
    float m = -3.0e38f;
    for (int64_t i = first; i < np; i++) m = sp[i] > m ? sp[i] : m;
    for (int64_t i = 0; i < first; i++) sp[i] = m;  /* masked below */
    for (int64_t i = np; i < n8; i++) sp[i] = m;  /* padding, masked below */
    __m256 mv = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp + i), mv));
      if (i + 8 > np) e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(np - i)), lane)));
      if (i < first) e = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(first - i)), lane)), e);
      _mm256_storeu_ps(sp + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    inv[p] = 1.0f / hsum8(sum);
  }
  for (int p0 = 0; p0 < P; p0 += 8) {  /* up to 8 pairs' accumulators in registers */
    const int pn = P - p0 < 8 ? P - p0 : 8;
    int64_t lo = n[p0], hi = n[p0];
    for (int b = 1; b < pn; b++) {
      lo = n[p0 + b] < lo ? n[p0 + b] : lo;
      hi = n[p0 + b] > hi ? n[p0 + b] : hi;
    }
    const float* w = s + (size_t)p0 * stride;
    memset(acc_out, 0, sizeof(float) * (size_t)pn * D);
    for (int64_t i0 = 0; i0 < hi; i0 += IB) {
      const int64_t i1 = i0 + IB;
      switch (pn) {  /* a constant count, so the accumulators stay in registers */
        case 1: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 1); break;
        case 2: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 2); break;
        case 3: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 3); break;
        case 4: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 4); break;
        case 5: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 5); break;
        case 6: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 6); break;
        case 7: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 7); break;
        default: weigh(V, D, w, stride, i0, i1, lo, n + p0, acc_out, 8); break;
      }
    }
    for (int b = 0; b < pn; b++) {
      const int p = p0 + b, r = p / G, a = p % G;
      float* o = j->out + (size_t)(t0 + r) * H * D + (size_t)(g * G + a) * D;
      const __m256 iv = _mm256_set1_ps(inv[p]);
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc_out + (size_t)b * D + d), iv));
    }
  }
}

static void attend(void* arg, size_t task) {
  const Jobs* js = (const Jobs*)arg;
  int64_t b = 0;
  while (b + 1 < js->B && js->first[b + 1] <= task) b++;
  attend_one(&js->jobs[b], task - js->first[b]);
}

/* ---- the onnxruntime kernel ------------------------------------------------------ */

typedef struct { const OrtApi* api; int64_t H, Hkv, D, layer, layers, rotary, window; float scale, cap; } Kernel;

#define BAD(msg) api->CreateStatus(ORT_INVALID_ARGUMENT, "SlabAttention: " msg)

/* every sequence's extent checked against the call and the pool before a byte is
 * written: rows partition [0, T) in order, past + rows <= R, slabs inside the pool and
 * apart from each other (two tasks never write one slot) */
static OrtStatus* check_seqs(const OrtApi* api, const Kernel* kn, const int64_t* sq, int64_t B, int64_t T,
                             int64_t N, int64_t P, int64_t half) {
  int64_t row = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t* e = sq + b * SEQ_FIELDS;
    if (e[0] != row || e[1] < 1 || e[2] < 0 || e[3] < 1 || e[4] < 0) return BAD("seqs rows must pack [0, T) in order, each non-empty");
    row += e[1];
    if (e[2] + e[1] > e[3]) return BAD("a sequence's past + rows exceeds its reserved positions");
    const int64_t size = 2 * kn->layers * kn->Hkv * e[3] * kn->D;
    if (e[4] > N || size > N - e[4]) return BAD("a sequence's slab lies outside the pool");
    if (kn->rotary && (P < e[2] + e[1] || 2 * half > kn->D)) return BAD("RoPE tables [>= past + rows, <= D / 2]");
    for (int64_t c = 0; c < b; c++) {
      const int64_t* o = sq + c * SEQ_FIELDS;
      if (e[4] < o[4] + 2 * kn->layers * kn->Hkv * o[3] * kn->D && o[4] < e[4] + size)
        return BAD("two sequences' slabs overlap");
    }
  }
  return row == T ? NULL : BAD("seqs rows must cover qkv's T rows");
}

static OrtStatus* compute(void* self, OrtKernelContext* ctx) {
  const Kernel* kn = (const Kernel*)self;
  const OrtApi* api = kn->api;
  const OrtValue* in[5];
  for (size_t i = 0; i < 5; i++) TRY(api->KernelContext_GetInput(ctx, i, &in[i]));
  int64_t qd[4], pd[4], sd[4], cd[4], nd[4];
  size_t nq, np_, ns, nc, nn;
  TRY(dims(api, in[0], qd, &nq));
  TRY(dims(api, in[1], pd, &np_));
  TRY(dims(api, in[2], sd, &ns));
  TRY(dims(api, in[3], cd, &nc));
  TRY(dims(api, in[4], nd, &nn));
  const int H = (int)kn->H, Hkv = (int)kn->Hkv, D = (int)kn->D;
  if (nq != 2 || qd[1] != (int64_t)(H + 2 * Hkv) * D) return BAD("qkv is [T, (H + 2 Hkv) D]");
  if (ns != 2 || sd[1] != SEQ_FIELDS || sd[0] < 1) return BAD("seqs is [B >= 1, 5]");
  if (nc != 2 || nn != 2 || cd[0] != nd[0] || cd[1] != nd[1]) return BAD("cos and sin are [P, rd / 2] alike");
  int64_t N = 1;
  for (size_t i = 0; i < np_; i++) N *= pd[i];
  void *p_qkv, *p_pool, *p_seqs, *p_cos, *p_sin, *p_out;
  TRY(api->GetTensorMutableData((OrtValue*)in[0], &p_qkv));
  TRY(api->GetTensorMutableData((OrtValue*)in[1], &p_pool));
  TRY(api->GetTensorMutableData((OrtValue*)in[2], &p_seqs));
  TRY(api->GetTensorMutableData((OrtValue*)in[3], &p_cos));
  TRY(api->GetTensorMutableData((OrtValue*)in[4], &p_sin));
  const int64_t T = qd[0], B = sd[0], half = cd[1], *sq = (const int64_t*)p_seqs;
  TRY(check_seqs(api, kn, sq, B, T, N, cd[0], half));
  int64_t od[2] = {T, (int64_t)H * D};
  OrtValue* o_out;
  TRY(api->KernelContext_GetOutput(ctx, 0, od, 2, &o_out));
  TRY(api->GetTensorMutableData(o_out, &p_out));
  const float *cs = kn->rotary ? (const float*)p_cos : NULL, *sn = kn->rotary ? (const float*)p_sin : NULL;
  const int width = (H + 2 * Hkv) * D;
  Job* jobs = (Job*)malloc(sizeof(Job) * (size_t)B);
  size_t* first = (size_t*)malloc(sizeof(size_t) * (size_t)(B + 1));
  if (!jobs || !first) { free(jobs); free(first); return api->CreateStatus(ORT_FAIL, "SlabAttention: out of memory"); }
  int failed = 0;
  first[0] = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t* e = sq + b * SEQ_FIELDS;
    const int64_t R = e[3], past = e[2], rows = e[1];
    float* slab = (float*)p_pool + e[4];
    float* K = slab + (size_t)kn->layer * Hkv * R * D;
    float* V = slab + (size_t)(kn->layers + kn->layer) * Hkv * R * D;
    const float* qkv = (const float*)p_qkv + (size_t)e[0] * width;
    for (int64_t t = 0; t < rows; t++) {  /* the new rows first: row t attends to itself */
      const int64_t pos = past + t;
      const float* row = qkv + (size_t)t * width;
      for (int g = 0; g < Hkv; g++) {
        rope(row + (size_t)(H + g) * D, K + ((size_t)g * R + pos) * D, D,
             cs ? cs + pos * half : NULL, sn ? sn + pos * half : NULL, (int)half);
        memcpy(V + ((size_t)g * R + pos) * D, row + (size_t)(H + Hkv + g) * D, sizeof(float) * D);
      }
    }
    jobs[b] = (Job){H, Hkv, D, (int)half, kn->scale, kn->cap, kn->window, qkv, cs, sn, K, V,
                    (float*)p_out + (size_t)e[0] * H * D, R, past, rows, &failed};
    first[b + 1] = first[b] + (size_t)((rows + ROWS - 1) / ROWS * Hkv);
  }
  Jobs all = {jobs, first, B};
  OrtStatus* st = api->KernelContext_ParallelFor(ctx, attend, first[B], 0, &all);
  free(jobs);
  free(first);
  if (st) return st;
  return __atomic_load_n(&failed, __ATOMIC_RELAXED) ? api->CreateStatus(ORT_FAIL, "SlabAttention: out of memory for the scores") : NULL;
}

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return api->CreateStatus(ORT_FAIL, "SlabAttention: out of memory");
  k->api = api;
  const char* ints[] = {"num_heads", "kv_num_heads", "head_dim", "layer", "num_layers", "rotary", "window"};
  int64_t* slots[] = {&k->H, &k->Hkv, &k->D, &k->layer, &k->layers, &k->rotary, &k->window};
  OrtStatus* st = NULL;
  for (int i = 0; i < 7 && !st; i++) st = api->KernelInfoGetAttribute_int64(info, ints[i], slots[i]);
  if (!st) st = api->KernelInfoGetAttribute_float(info, "scale", &k->scale);
  if (!st) st = api->KernelInfoGetAttribute_float(info, "softcap", &k->cap);
  if (!st && (k->H <= 0 || k->Hkv <= 0 || k->H % k->Hkv || k->H / k->Hkv > 64 || k->D % 16 || k->D <= 0 ||
              k->D > 512 || k->layer < 0 || k->layer >= k->layers || k->window < 0))
    st = BAD("num_heads a multiple of kv_num_heads (at most 64 a KV head), head_dim % 16 == 0 and <= 512, "
             "0 <= layer < num_layers, window >= 0");
  if (st) { free(k); return st; }
  *out = k;
  return NULL;
}

static const char* name(const OrtCustomOp* op) { (void)op; return "SlabAttention"; }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 2 ? T_INT64 : T_FLOAT; }
static size_t inputs(const OrtCustomOp* op) { (void)op; return 5; }
static size_t outputs(const OrtCustomOp* op) { (void)op; return 1; }

OrtCustomOp slab_attention_op = {
  .version = API_VERSION, .GetName = name, .GetExecutionProviderType = op_cpu,
  .GetInputType = input_type, .GetInputTypeCount = inputs, .GetOutputType = op_float,
  .GetOutputTypeCount = outputs, .KernelDestroy = op_free, .GetInputCharacteristic = op_required,
  .GetOutputCharacteristic = op_required, .GetInputMemoryType = op_cpu_memory,
  .CreateKernelV2 = create, .KernelComputeV2 = compute,
};
