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
 *          gated (default 0). Gated: B holds 2 ceil(N / 8) groups, a gate projection's
 *          group then an up projection's group of the same 8 columns (gguf_pack.py's
 *          pack_gated), and Y = silu(A G^T) * (A U^T): an MLP's gate, up and
 *          activation in one op, with no [.., 2N] tensor between (no bias).
 * Written with 256-bit AVX2 (as llama.cpp's K-quant dot products are, AVX-512 hosts
 * included); where the host has VNNI, its dot product saves two instructions.
 */
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "ort_api.h"
#include "vec_math.h"

enum { QK = 256, TYPE_Q4_K = 12, TYPE_Q6_K = 14, GROUPS_PER_TASK = 16, ROWS_PER_TASK = 64 };
/* rows a tile: a verify of up to MR rows reads and unpacks each weight once; 8 where
 * AVX-512 gives 32 vector registers (a 5-row verify of the 1.5B's Q4_K as 4 + 1 rows
 * cost 2.1x one row, measured; 8 a tile keeps three int32 sums a row in registers) */
#if defined(__AVX512VL__)
#define MR_8 1
enum { MR = 8, NARROW = 2 };
#else
#define MR_8 0
enum { MR = 4, NARROW = 1 };  /* (16 vector registers) */
#endif
/* bytes ahead in a task's stream, prefetched by tiles of two rows or more: a verify's
 * tiles are slow enough per byte to lose the hardware prefetcher (Q6_K at 5 rows 11 ->
 * 15 GB/s, at 8 rows 9 -> 14, 2 rows +5% with 2 KB ahead; 16 KB ahead did worse), while
 * one row, read in address order, streams fastest with none (this AMD EPYC, 2 threads) */
enum { PREFETCH = 2048 };

typedef struct {
  const uint8_t* w;
  const int8_t* qa;   /* [M, K] quantized activations */
  const float* ad;    /* [M, K / 256] their scale per super-block */
  const int16_t* bs;  /* [M, K / 16] sums of 16 quantized activations */
  const int16_t* bs32;  /* [M, K / 32] sums of 32 */
  const float* bias;   /* [N] or NULL */
  float* y;
  int64_t M, N, K;
  int type, nsb, col_tasks, gated;
} Job;

static inline int32_t hsum_i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* ---- activations: a row quantized to int8 per super-block (llama.cpp's Q8_K) ---- */

static void quantize_row(const Job* j, const float* a, int8_t* q, float* ad, int16_t* bs, int16_t* bs32) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int s = 0; s < j->nsb; s++, a += QK, q += QK, bs += QK / 16, bs32 += QK / 32) {
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < QK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(a + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float d = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))) / 127.0f;
    ad[s] = d;
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    for (int i = 0; i < QK; i += 16) {
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + i), inv));
      const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(a + i + 8), inv));
      bs[i / 16] = (int16_t)hsum_i(_mm256_add_epi32(q0, q1));
      if (i % 32) bs32[i / 32] = (int16_t)(bs[i / 16 - 1] + bs[i / 16]);
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  /* in order */
      _mm_storeu_si128((__m128i*)(q + i), _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
    }
  }
}

typedef struct { const Job* j; const float* a; int8_t* qa; float* ad; int16_t *bs, *bs32; } Quant;

static void quantize_task(void* arg, size_t m) {
  const Quant* q = (const Quant*)arg;
  const Job* j = q->j;
  quantize_row(j, q->a + m * j->K, q->qa + m * j->K, q->ad + m * j->nsb, q->bs + m * (j->K / 16),
               q->bs32 + m * (j->K / 32));
}

/* ---- tiles: mr rows against one group of 8 columns ------------------------------
 * The weights are 8 columns interleaved (gguf_pack.py): each int32 lane holds one
 * column's 4 consecutive values, so one dot product against 4 broadcast activations
 * serves 8 columns, a lane keeps its column from the first block to the output (no
 * horizontal sums), and the scales of 8 columns load as one vector. Every (row, column)
 * runs the same operations whatever mr is. */

/* acc + the sums of 4 unsigned x signed byte products per int32 lane: exact either way */
static inline __m256i dot4(__m256i acc, __m256i w, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, a);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, a);
#else  /* (a 4-bit or 6-bit weight times an int8 leaves maddubs' int16 pairs unsaturated) */
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
#endif
}

static inline __m256i bcast4(const void* a) { int32_t v; memcpy(&v, a, 4); return _mm256_set1_epi32(v); }

/* acc + (p[2i] s[2i] + p[2i+1] s[2i+1]) per int32 lane, int16 pairs: exact either way */
static inline __m256i dot2(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

/* the bytes of sub-blocks 2p and 2p + 1 of 8 columns ([sub-block][column] at p8) as one
 * int16 pair a lane, column by column */
static inline __m256i pairs_u8(const uint8_t* p8) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p8);
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
}
static inline __m256i pairs_i8(const uint8_t* p8) {
  const __m128i v = _mm_loadu_si128((const __m128i*)p8);
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
}

/* the 8 columns' byte-wide values of one sub-block, widened to int32 lanes */
static inline __m256i lanes_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256i lanes_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

/* (__builtin_prefetch: GCC 12 at -O2 dropped every _mm_prefetch of this file's inlined
 * loops as dead code: this op never prefetched before, whatever PREFETCH said) */
static inline void prefetch(const uint8_t* p, int bytes) {
  for (int l = 0; l < bytes; l += 64) __builtin_prefetch(p + PREFETCH + l, 0, 3);
}

/* silu(g) u = g u / (1 + e^-g) */
static inline __m256 swiglu(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(_mm256_mul_ps(g, u), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

static inline void store(const Job* j, int64_t m, int64_t n0, __m256 acc) {
  float* y = j->y + (size_t)m * j->N + n0;
  if (n0 + 8 <= j->N) { _mm256_storeu_ps(y, acc); return; }
  float t[8];  /* the last group's padding columns (zero blocks) are dropped */
  _mm256_storeu_ps(t, acc);
  memcpy(y, t, (size_t)(j->N - n0) * sizeof(float));
}

/* Q4_K, a group's super-block: d[8] fp16, dmin[8] fp16, scales[8 sub-blocks][8], mins[8][8],
 * then qs[4 (64 values)][8 (4 bytes)][8 columns][4]: low nibbles sub-block 2k, high 2k + 1 */
enum { Q4K_GROUP = 16 + 16 + 64 + 64 + 1024, Q6K_GROUP = 1024 + 512 + 16 + 128 + 16 };

/* super-block s of group g into the rows' accumulators */
static inline __attribute__((always_inline)) void q4k_block(const Job* j, int64_t m0, const int mr, int64_t g,
                                                            int s, const int8_t* const* qa, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(15);
  {
    const uint8_t* b = j->w + ((size_t)g * j->nsb + s) * Q4K_GROUP;
    if (mr > 1) prefetch(b, Q4K_GROUP);
    __m256i isum[MR];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
      __m256i lo[MR], hi[MR];
#pragma GCC unroll 8
      for (int r = 0; r < mr; r++) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int q = 0; q < 8; q++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(b + 160 + (k * 8 + q) * 32));
        const __m256i wl = _mm256_and_si256(v, low), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
          const int8_t* a = qa[r] + s * QK + 64 * k + 4 * q;
          lo[r] = dot4(lo[r], wl, bcast4(a));
          hi[r] = dot4(hi[r], wh, bcast4(a + 32));
        }
      }
      const __m256i sl = lanes_u8(b + 32 + 16 * k), sh = lanes_u8(b + 32 + 16 * k + 8);
#pragma GCC unroll 8
      for (int r = 0; r < mr; r++)
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(lo[r], sl), _mm256_mullo_epi32(hi[r], sh)));
    }
    __m256i mp[4];  /* minimums of sub-blocks 2p, 2p + 1 */
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) mp[p] = pairs_u8(b + 96 + 16 * p);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)b));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 16)));
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      __m256i msum = _mm256_setzero_si256();  /* minimums x their sub-blocks' activation sums */
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++)
        msum = dot2(msum, mp[p], bcast4(j->bs32 + (size_t)(m0 + r) * (j->K / 32) + s * 8 + 2 * p));
      const __m256 ad = _mm256_set1_ps(j->ad[(m0 + r) * j->nsb + s]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, ad), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[r]);
    }
  }
}

/* Q6_K's float part: q is stored plus 32, so less 32 x scale x each sub-block's
 * activation sum, then one product with d and the row's scale */
static inline __attribute__((always_inline)) void q6k_finish(const Job* j, int64_t m0, const int mr, const uint8_t* b,
                                                             int s, const __m256i* isum, __m256* acc) {
  const uint8_t* sc8 = b + 1552;
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 1536)));
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    __m256i off = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++)
      off = dot2(off, _mm256_slli_epi16(pairs_i8(sc8 + 16 * p), 5),
                 bcast4(j->bs + (size_t)(m0 + r) * (j->K / 16) + s * 16 + 2 * p));
    const __m256 ad = _mm256_set1_ps(j->ad[(m0 + r) * j->nsb + s]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], off)), _mm256_mul_ps(d, ad), acc[r]);
  }
}

/* Q6_K, a group's super-block: [2 halves][8 steps](ql[0][8 columns][4] | ql[1][8][4] |
 * qh[8][4]), d[8] fp16, scales[16 sub-blocks][8] int8, 16 bytes of padding: 1696 bytes,
 * a multiple of 32, so no 32-byte load straddles two cache lines (at 1680, every other
 * block's did: it streamed at 15-22 GB/s). A step's three rows lie together: one row's
 * loop (q6k_block_narrow) reads a block in address order (with the file's ql, ql, qh
 * order it streamed at 19-21 GB/s, 27-29 in order, one row, 181 MB, this AMD EPYC) */
static inline __attribute__((always_inline)) void q6k_block(const Job* j, int64_t m0, const int mr, int64_t g,
                                                            int s, const int8_t* const* qa, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(15);
  {
    const uint8_t* b = j->w + ((size_t)g * j->nsb + s) * Q6K_GROUP;
    prefetch(b, Q6K_GROUP);  /* (this loop runs for mr > NARROW: two rows or more) */
    const uint8_t* sc8 = b + 1552;
    __m256i isum[MR];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) isum[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++) {  /* values 128h + 32k ..: sub-blocks 8h + 2k and 8h + 2k + 1 */
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
          __m256i sub[MR];
#pragma GCC unroll 8
          for (int r = 0; r < mr; r++) sub[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
          for (int q = 4 * half; q < 4 * half + 4; q++) {
            const __m256i l = _mm256_loadu_si256((const __m256i*)(b + (h * 8 + q) * 96 + (k & 1) * 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + (h * 8 + q) * 96 + 64));
            const __m256i l4 = _mm256_and_si256(k < 2 ? l : _mm256_srli_epi16(l, 4), low);
            const __m256i h2 = k == 0 ? _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x03)), 4)
                             : k == 1 ? _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x0C)), 2)
                             : k == 2 ? _mm256_and_si256(hb, _mm256_set1_epi8(0x30))
                                      : _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8((char)0xC0)), 2);
            const __m256i w = _mm256_or_si256(l4, h2);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) sub[r] = dot4(sub[r], w, bcast4(qa[r] + s * QK + 128 * h + 32 * k + 4 * q));
          }
          const int sb = 8 * h + 2 * k + half;
          const __m256i sc = lanes_i8(sc8 + 8 * sb);
#pragma GCC unroll 8
          for (int r = 0; r < mr; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(sub[r], sc));
        }
      }
    }
    q6k_finish(j, m0, mr, b, s, isum, acc);
  }
}

/* Q6_K for one or two rows: each (half, step)'s ql and qh loads serve all four of its
 * sub-blocks' values (the loop above loads qh four times and keeps one sub-block's sums
 * a row; with so few rows it is bound by those loads and shifts, not by memory). The
 * same exact integer sums: a row's result is bitwise the wide loop's. */
static inline __attribute__((always_inline)) void q6k_block_narrow(const Job* j, int64_t m0, const int mr, int64_t g,
                                                                   int s, const int8_t* const* qa, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(15);
  const uint8_t* b = j->w + ((size_t)g * j->nsb + s) * Q6K_GROUP;
  if (mr > 1) prefetch(b, Q6K_GROUP);
  const uint8_t* sc8 = b + 1552;
  __m256i isum[NARROW];
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++) isum[r] = _mm256_setzero_si256();
  for (int h = 0; h < 2; h++) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
      __m256i sub[4][NARROW];  /* sub-blocks 8h + 2k + half, k = 0..3 */
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++)
#pragma GCC unroll 2
        for (int r = 0; r < mr; r++) sub[k][r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int q = 4 * half; q < 4 * half + 4; q++) {
        const uint8_t* step = b + (h * 8 + q) * 96;  /* in address order */
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)step);
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(step + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(step + 64));
        const __m256i w[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x03)), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x0C)), 2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, _mm256_set1_epi8(0x30))),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                          _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8((char)0xC0)), 2))};
#pragma GCC unroll 2
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
          for (int k = 0; k < 4; k++)
            sub[k][r] = dot4(sub[k][r], w[k], bcast4(qa[r] + s * QK + 128 * h + 32 * k + 4 * q));
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++) {
        const __m256i sc = lanes_i8(sc8 + 8 * (8 * h + 2 * k + half));
#pragma GCC unroll 2
        for (int r = 0; r < mr; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(sub[k][r], sc));
      }
    }
  }
  q6k_finish(j, m0, mr, b, s, isum, acc);
}

/* acc[r] = rows m0.. of A times group g's 8 columns */
static inline __attribute__((always_inline)) void tile(const Job* j, int64_t m0, const int mr, int64_t g, __m256* acc) {
  const int8_t* qa[MR];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) {
    acc[r] = _mm256_setzero_ps();
    qa[r] = j->qa + (size_t)(m0 + r) * j->K;
  }
  for (int s = 0; s < j->nsb; s++) {
    if (j->type == TYPE_Q4_K) q4k_block(j, m0, mr, g, s, qa, acc);
    else if (mr <= NARROW) q6k_block_narrow(j, m0, mr, g, s, qa, acc);
    else q6k_block(j, m0, mr, g, s, qa, acc);
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
      float b[8] = {0};
      memcpy(b, j->bias + c * 8, (size_t)(j->N - c * 8 < 8 ? j->N - c * 8 : 8) * sizeof(float));
      const __m256 bv = _mm256_loadu_ps(b);
#pragma GCC unroll 8
      for (int r = 0; r < mr; r++) acc[r] = _mm256_add_ps(acc[r], bv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) store(j, m0 + r, c * 8, acc[r]);
}

/* a task: its groups of output columns one at a time, each against all its rows, MR at
 * a time, so a group's weights come from memory once and from the cache for the next rows */
static void task(void* arg, size_t t) {
  const Job* j = (const Job*)arg;
  const int64_t groups = (j->N + 7) / 8;  /* of Y's columns (gated: two of B's groups each) */
  const int64_t g0 = (int64_t)(t % j->col_tasks) * GROUPS_PER_TASK, g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
  const int64_t m0 = (int64_t)(t / j->col_tasks) * ROWS_PER_TASK, m1 = m0 + ROWS_PER_TASK < j->M ? m0 + ROWS_PER_TASK : j->M;
  for (int64_t g = g0; g < g1; g++) {
    int64_t m = m0;
    for (; m + MR <= m1; m += MR) out_tile(j, m, MR, g);
    switch (m1 - m) {  /* (each width its own inlined copy, its loops unrolled) */
#if MR_8
      case 7: out_tile(j, m, 7, g); break;
      case 6: out_tile(j, m, 6, g); break;
      case 5: out_tile(j, m, 5, g); break;
      case 4: out_tile(j, m, 4, g); break;
#endif
      case 3: out_tile(j, m, 3, g); break;
      case 2: out_tile(j, m, 2, g); break;
      case 1: out_tile(j, m, 1, g); break;
      default: break;
    }
  }
}

/* ---- the onnxruntime kernel ------------------------------------------------------ */

typedef struct { const OrtApi* api; int64_t K, N, type, gated; } Kernel;

static int64_t group_bytes(int64_t type) { return type == TYPE_Q4_K ? Q4K_GROUP : Q6K_GROUP; }

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
  if (na < 1 || ad[na - 1] != K || nb != 3 || bd[0] != (kn->gated ? 2 : 1) * ((N + 7) / 8) || bd[1] != K / QK
      || bd[2] != group_bytes(kn->type))
    return api->CreateStatus(ORT_INVALID_ARGUMENT, kn->gated
                             ? "GGUFMatMul: A [..., K], B [2 ceil(N / 8), K / 256, bytes a group's super-block] (gated)"
                             : "GGUFMatMul: A [..., K], B [ceil(N / 8), K / 256, bytes a group's super-block]");
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
  Job j = {.w = (const uint8_t*)pb, .bias = (const float*)pbias, .y = (float*)py, .M = M, .N = N, .K = K,
           .type = (int)kn->type, .nsb = (int)(K / QK), .gated = (int)kn->gated};
  j.col_tasks = (int)(((N + 7) / 8 + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK);
  const size_t qbytes = ((size_t)M * K + 63) & ~(size_t)63, fbytes = ((size_t)M * j.nsb * 4 + 63) & ~(size_t)63;
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
  }
  if (!st && ((k->type != TYPE_Q4_K && k->type != TYPE_Q6_K) || k->K <= 0 || k->K % QK || k->N <= 0))
    st = api->CreateStatus(ORT_INVALID_ARGUMENT, "GGUFMatMul: type 12 (Q4_K) or 14 (Q6_K), K a multiple of 256");
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
