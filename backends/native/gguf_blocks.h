/* GGUFMatMul's inner loops (gguf_matmul.c has the op, its layout and its numerics):
 * one super-block of a group of 8 interleaved columns (gguf_pack.py) against up to
 * MR quantized activation rows, every sum an exact integer per lane. */
#ifndef HETERO_SD_GGUF_BLOCKS_H
#define HETERO_SD_GGUF_BLOCKS_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

enum { QK = 256, TYPE_Q4_K = 12, TYPE_Q6_K = 14, GROUPS_PER_TASK = 16, ROWS_PER_TASK = 64 };
/* the 32-value block types (ggml's numbering), read in units of two blocks (QU values) */
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8, QB = 32, QU = 64 };
/* rows a tile: a verify of up to MR rows reads and unpacks each weight once; 8 where
 * AVX-512 gives 32 vector registers (a 5-row verify of the 1.5B's Q4_K as 4 + 1 rows
 * cost 2.1x one row, measured; 8 a tile keeps three int32 sums a row in registers) */
#if defined(__AVX512VL__)
#define MR_8 1
/* (Q4_K's tiles stop at 6: at 8 its three sums a row spilled, an 8-row verify of the
 * 1.5B's MLP layers 9.0 ms as 8 rows against 7.5 as 6 + 2; Q6_K's head was faster as 8) */
enum { MR = 8, NARROW = 2, MR_Q4K = 6 };
#else
#define MR_8 0
enum { MR = 4, NARROW = 1, MR_Q4K = 4 };  /* (16 vector registers) */
#endif
/* bytes ahead in a task's stream, prefetched at every width: a verify's tiles are slow
 * enough per byte to lose the hardware prefetcher (Q6_K at 5 rows 11 -> 15 GB/s with
 * 2 KB ahead, then 4-6% faster at 2 and 5 rows with 4 KB; 8 KB level, 16 KB worse), and
 * with 4 KB one row streams faster too (the 1.5B's MLP layers 2.91 -> 2.69 ms, its head
 * 7% faster; with 2 KB one row had been fastest with none; the 0.5B's short Q5_0 units
 * 42 -> 50 GB/s) (this AMD EPYC, 2 threads, side by side) */
enum { PREFETCH = 4096 };

typedef struct {
  const uint8_t* w;
  const int8_t* qa;   /* [M, K] quantized activations */
  const float* ad;    /* [M, K / 256] their scale per super-block ([M, K / 32] per block: 32-value types) */
  const int16_t* bs;  /* [M, K / 16] sums of 16 quantized activations */
  const int16_t* bs32;  /* [M, K / 32] sums of 32 */
  const float* bias;   /* [N] or NULL */
  float* y;
  int64_t M, N, K;
  int type, nsb, col_tasks, gated;
  int nab;  /* activation blocks a row: K / 256, or K / 32 for the 32-value types */
} Job;

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

/* as dot4 for weights of all 8 bits (Q8_0's q + 128): without VNNI, maddubs would saturate
 * its int16 pairs (255 x 127 x 2 > 32767), so the weight goes in as its two nibbles,
 * each pair then small enough, and the high one's sums count 16 times: exact */
static inline __m256i dot4_u8(__m256i acc, __m256i w, __m256i a) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return dot4(acc, w, a);
#else
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(w, low), a);
  const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), a);
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(hi, _mm256_set1_epi16(16)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
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

/* group g's unit s (a super-block, or two 32-value blocks), PREFETCH bytes ahead fetched */
static inline const uint8_t* block_at(const Job* j, int64_t g, int s, int bytes) {
  const uint8_t* b = j->w + ((size_t)g * j->nsb + s) * bytes;
  prefetch(b, bytes);
  return b;
}

/* ---- K-quants: step pairs ----------------------------------------------------------
 * Q4_K's and Q6_K's values come in step pairs of 64 bytes (two steps of 4 values, 8
 * columns), laid out for the build (gguf_pack.py; the op's `pairs` attribute says which,
 * and must be this build's PAIRS):
 *   PAIRS 1 (AVX-512 VNNI): a column's two steps together, so a 512-bit load is a whole
 *     pair with each 64-bit lane a column's, fed by one 64-bit broadcast of the pair's 8
 *     activations: the dot product runs 16 lanes wide (on this AMD EPYC, 9.0 G vpdpbusd a
 *     second a core at 512 bits as at 256: twice the products), a column's two lanes
 *     added once a super-block (exact integers);
 *   PAIRS 0 (AVX2): one step's 8 columns, then the next's: two 256-bit loads, one int32
 *     lane a column (taking the other layout apart cost an AVX2 5-row Q6_K head 11%).
 * The loops below are written once over `vec`. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
enum { PAIRS = 1 };
typedef __m512i vec;
enum { NV = 1 };  /* vectors a step pair */
static inline vec v_dot(vec acc, vec w, vec a) { return _mm512_dpbusd_epi32(acc, w, a); }
static inline vec v_dot8(vec acc, vec w, vec a) { return _mm512_dpbusd_epi32(acc, w, a); }
static inline void v_pair(const uint8_t* p, vec* v) { v[0] = _mm512_loadu_si512((const void*)p); }
/* the activations of step t of a pair (a: the pair's 8) */
static inline vec v_acts(const int8_t* a, int t) { int64_t x; (void)t; memcpy(&x, a, 8); return _mm512_set1_epi64(x); }
/* 8 columns' scale bytes (unsigned, signed) as the sums' lanes: each column's twice */
static inline vec v_scales_u8(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64((const __m128i*)p);
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v));
}
static inline vec v_scales_i8(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64((const __m128i*)p);
  return _mm512_cvtepi8_epi32(_mm_unpacklo_epi8(v, v));
}
/* a sum's 8 columns, one int32 lane each: a column's two lanes added (a 64-bit lane's low half) */
static inline __m256i v_columns(vec x) { return _mm512_cvtepi64_epi32(_mm512_add_epi64(x, _mm512_srli_epi64(x, 32))); }
/* Q5's bit planes of 8 columns (a dword each) as the pairs' lanes: each column's twice */
static inline vec v_planes(const uint8_t* p) {
  const vec x = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_or_si512(x, _mm512_slli_epi64(x, 32));
}
/* step 2p + t's fifth bits at bit 4 of each byte (and bits elsewhere, masked by the caller):
 * of the low values (plane 2p + t), of the high ones (plane 4 + 2p + t); t per 32-bit lane */
static inline vec v_fifth_low(vec hb, int p, int t) {
  (void)t;
  return _mm512_sllv_epi32(hb, _mm512_set1_epi64(((int64_t)(3 - 2 * p) << 32) | (4 - 2 * p)));
}
static inline vec v_fifth_high(vec hb, int p, int t) {
  (void)t;
  return _mm512_srlv_epi32(hb, _mm512_set1_epi64(((int64_t)(2 * p + 1) << 32) | (2 * p)));
}
#define V_(op) _mm512_##op
#else
enum { PAIRS = 0 };
typedef __m256i vec;
enum { NV = 2 };
static inline vec v_dot(vec acc, vec w, vec a) { return dot4(acc, w, a); }
static inline vec v_dot8(vec acc, vec w, vec a) { return dot4_u8(acc, w, a); }  /* all 8 bits: Q8_0 */
/* a pair's even step, then its odd one, 8 columns each */
static inline void v_pair(const uint8_t* p, vec* v) {
  v[0] = _mm256_loadu_si256((const __m256i*)p);
  v[1] = _mm256_loadu_si256((const __m256i*)(p + 32));
}
static inline vec v_acts(const int8_t* a, int t) { return bcast4(a + 4 * t); }
static inline vec v_scales_u8(const uint8_t* p) { return lanes_u8(p); }
static inline vec v_scales_i8(const uint8_t* p) { return lanes_i8(p); }
static inline __m256i v_columns(vec x) { return x; }
static inline vec v_planes(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
/* (16-bit shifts: what crosses a byte lands below bit 4 or above it, masked by the caller) */
static inline vec v_fifth_low(vec hb, int p, int t) { return _mm256_slli_epi16(hb, 4 - (2 * p + t)); }
static inline vec v_fifth_high(vec hb, int p, int t) { return _mm256_srli_epi16(hb, 2 * p + t); }
#define V_(op) _mm256_##op
#endif
/* the same operations at either width (V_: the width's intrinsic) */
static inline vec v_zero(void) { return (vec){0}; }
static inline vec v_bytes(char c) { return V_(set1_epi8)(c); }
static inline vec v_and(vec a, vec b) { return a & b; }
static inline vec v_or(vec a, vec b) { return a | b; }
#define v_srli16(a, n) V_(srli_epi16)(a, n)
#define v_slli16(a, n) V_(slli_epi16)(a, n)
static inline vec v_add(vec a, vec b) { return V_(add_epi32)(a, b); }
static inline vec v_mul(vec a, vec b) { return V_(mullo_epi32)(a, b); }

/* Q4_K, a group's super-block: d[8] fp16, dmin[8] fp16, scales[8 sub-blocks][8], mins[8][8],
 * then qs[4 (64 values)][4 step pairs][64 bytes, as PAIRS says]: low nibbles sub-block 2k, high 2k + 1 */
enum { Q4K_GROUP = 16 + 16 + 64 + 64 + 1024, Q6K_GROUP = 1024 + 512 + 16 + 128 + 16 };

/* super-block s of group g into the rows' accumulators */
static inline __attribute__((always_inline)) void q4k_block(const Job* j, int64_t m0, const int mr, int64_t g,
                                                            int s, const int8_t* const* qa, __m256* acc) {
  const vec low = v_bytes(15);
  const uint8_t* b = block_at(j, g, s, Q4K_GROUP);
  vec isum[MR];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) isum[r] = v_zero();
#pragma GCC unroll 4
  for (int k = 0; k < 4; k++) {
    vec lo[MR], hi[MR];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) lo[r] = hi[r] = v_zero();
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
      vec v[NV];
      v_pair(b + 160 + (k * 4 + p) * 64, v);
#pragma GCC unroll 2
      for (int t = 0; t < NV; t++) {
        const vec wl = v_and(v[t], low), wh = v_and(v_srli16(v[t], 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
          const int8_t* a = qa[r] + s * QK + 64 * k + 8 * p;
          lo[r] = v_dot(lo[r], wl, v_acts(a, t));
          hi[r] = v_dot(hi[r], wh, v_acts(a + 32, t));
        }
      }
    }
    const vec sl = v_scales_u8(b + 32 + 16 * k), sh = v_scales_u8(b + 32 + 16 * k + 8);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) isum[r] = v_add(isum[r], v_add(v_mul(lo[r], sl), v_mul(hi[r], sh)));
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
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v_columns(isum[r])), _mm256_mul_ps(d, ad), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc[r]);
  }
}

/* Q6_K's float part: q is stored plus 32, so less 32 x scale x each sub-block's
 * activation sum, then one product with d and the row's scale */
static inline __attribute__((always_inline)) void q6k_finish(const Job* j, int64_t m0, const int mr, const uint8_t* b,
                                                             int s, const vec* isum, __m256* acc) {
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
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v_columns(isum[r]), off)), _mm256_mul_ps(d, ad), acc[r]);
  }
}

/* a step's 6-bit values of sub-block pair k (0..3; stored plus 32): ql's low (k < 2) or
 * high nibbles of l (the step's ql row k & 1), with qh's bits 2k, 2k + 1 above */
static inline vec q6k_values(vec l, vec hb, const int k) {
  const vec l4 = v_and(k < 2 ? l : v_srli16(l, 4), v_bytes(15));
  const vec h2 = k == 0 ? v_slli16(v_and(hb, v_bytes(0x03)), 4)
               : k == 1 ? v_slli16(v_and(hb, v_bytes(0x0C)), 2)
               : k == 2 ? v_and(hb, v_bytes(0x30))
                        : v_srli16(v_and(hb, v_bytes((char)0xC0)), 2);
  return v_or(l4, h2);
}

/* Q6_K, a group's super-block: [2 halves][4 step pairs](ql[0] | ql[1] | qh: 64 bytes each,
 * as PAIRS says), d[8] fp16, scales[16 sub-blocks][8] int8, 16 bytes of
 * padding: 1696 bytes, a multiple of 32, so no 32-byte load straddles two cache lines
 * (at 1680, every other block's did: it streamed at 15-22 GB/s). A pair's three rows lie
 * together: one row's loop (q6k_block_narrow) reads a block in address order (with the
 * file's ql, ql, qh order it streamed at 19-21 GB/s, 27-29 in order, one row, 181 MB) */
static inline __attribute__((always_inline)) void q6k_block(const Job* j, int64_t m0, const int mr, int64_t g,
                                                            int s, const int8_t* const* qa, __m256* acc) {
  const uint8_t *b = block_at(j, g, s, Q6K_GROUP), *sc8 = b + 1552;
  vec isum[MR];
#pragma GCC unroll 8
  for (int r = 0; r < mr; r++) isum[r] = v_zero();
  for (int h = 0; h < 2; h++) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {  /* values 128h + 32k ..: sub-blocks 8h + 2k and 8h + 2k + 1 */
#pragma GCC unroll 2
      for (int half = 0; half < 2; half++) {
        vec sub[MR];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) sub[r] = v_zero();
#pragma GCC unroll 2
        for (int p = 2 * half; p < 2 * half + 2; p++) {
          vec l[NV], hb[NV];
          v_pair(b + (h * 4 + p) * 192 + (k & 1) * 64, l);
          v_pair(b + (h * 4 + p) * 192 + 128, hb);
#pragma GCC unroll 2
          for (int t = 0; t < NV; t++) {
            const vec w = q6k_values(l[t], hb[t], k);
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) sub[r] = v_dot(sub[r], w, v_acts(qa[r] + s * QK + 128 * h + 32 * k + 8 * p, t));
          }
        }
        const vec sc = v_scales_i8(sc8 + 8 * (8 * h + 2 * k + half));
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) isum[r] = v_add(isum[r], v_mul(sub[r], sc));
      }
    }
  }
  q6k_finish(j, m0, mr, b, s, isum, acc);
}

/* Q6_K for one or two rows: each pair's ql and qh loads serve all four of its sub-blocks'
 * values (the loop above loads qh four times and keeps one sub-block's sums a row; with
 * so few rows it is bound by those loads and shifts, not by memory). The same exact
 * integer sums: a row's result is bitwise the wide loop's. */
static inline __attribute__((always_inline)) void q6k_block_narrow(const Job* j, int64_t m0, const int mr, int64_t g,
                                                                   int s, const int8_t* const* qa, __m256* acc) {
  const uint8_t *b = block_at(j, g, s, Q6K_GROUP), *sc8 = b + 1552;
  vec isum[NARROW];
#pragma GCC unroll 2
  for (int r = 0; r < mr; r++) isum[r] = v_zero();
  for (int h = 0; h < 2; h++) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; half++) {
      vec sub[4][NARROW];  /* sub-blocks 8h + 2k + half, k = 0..3 */
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++)
#pragma GCC unroll 2
        for (int r = 0; r < mr; r++) sub[k][r] = v_zero();
#pragma GCC unroll 2
      for (int p = 2 * half; p < 2 * half + 2; p++) {
        const uint8_t* pair = b + (h * 4 + p) * 192;  /* in address order */
        vec l0[NV], l1[NV], hb[NV];
        v_pair(pair, l0);
        v_pair(pair + 64, l1);
        v_pair(pair + 128, hb);
#pragma GCC unroll 2
        for (int t = 0; t < NV; t++) {
          const vec w[4] = {q6k_values(l0[t], hb[t], 0), q6k_values(l1[t], hb[t], 1), q6k_values(l0[t], hb[t], 2),
                            q6k_values(l1[t], hb[t], 3)};
#pragma GCC unroll 2
          for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
              sub[k][r] = v_dot(sub[k][r], w[k], v_acts(qa[r] + s * QK + 128 * h + 32 * k + 8 * p, t));
        }
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; k++) {
        const vec sc = v_scales_i8(sc8 + 8 * (8 * h + 2 * k + half));
#pragma GCC unroll 2
        for (int r = 0; r < mr; r++) isum[r] = v_add(isum[r], v_mul(sub[k][r], sc));
      }
    }
  }
  q6k_finish(j, m0, mr, b, s, isum, acc);
}

/* ---- the 32-value block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 ---------------------
 * A group's unit of two blocks (gguf_pack.py): d[2][8] fp16, m[2][8] fp16 (Q4_1, Q5_1),
 * qh[2][8 columns][4] (Q5_0, Q5_1: bit b of byte i is the fifth bit of value 4b + i for
 * b < 4, of value 16 + 4(b - 4) + i above), then qs: 4-bit types [2][2 step pairs] (a
 * byte's low nibble value 4s + i, its high one 16 + 4s + i, as in the file), Q8_0
 * [2][4 step pairs] stored plus 128, each pair 64 bytes as PAIRS says (above). Every
 * value is then unsigned (u), w = d (u - zero) or d u + m: a block's exact integer sum
 * u.a less zero x its activation sum, times d and the row's block scale; a minimum adds
 * m x (the row's scale x its sum). */
static inline int legacy_zero(int type) {
  return type == TYPE_Q8_0 ? 128 : type == TYPE_Q5_0 ? 16 : type == TYPE_Q4_0 ? 8 : 0;
}
static inline int legacy_min(int type) { return type == TYPE_Q4_1 || type == TYPE_Q5_1; }
static inline int legacy_high(int type) { return type == TYPE_Q5_0 || type == TYPE_Q5_1; }
static inline int legacy_bytes(int type) {
  return 32 + 32 * legacy_min(type) + 64 * legacy_high(type) + (type == TYPE_Q8_0 ? 512 : 256);
}

/* unit u of group g into the rows' accumulators; type a constant where inlined */
static inline __attribute__((always_inline)) void legacy_unit(const Job* j, int64_t m0, const int mr, int64_t g,
                                                              int u, const int8_t* const* qa, __m256* acc,
                                                              const int type) {
  const vec low = v_bytes(15), bit4 = v_bytes(0x10);
  const int bytes = legacy_bytes(type), zero = legacy_zero(type);
  const uint8_t* b = block_at(j, g, u, bytes);
  const uint8_t* qh = b + 32 + 32 * legacy_min(type);
  const uint8_t* qs = qh + 64 * legacy_high(type);
#pragma GCC unroll 2
  for (int h = 0; h < 2; h++) {  /* the unit's two blocks */
    vec s[MR];  /* one exact integer sum a row (two chains were slower at 512 bits: 8 rows spilled) */
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) s[r] = v_zero();
    if (type == TYPE_Q8_0) {
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) {
        vec w[NV];
        v_pair(qs + h * 256 + p * 64, w);
#pragma GCC unroll 2
        for (int t = 0; t < NV; t++)
#pragma GCC unroll 8
          for (int r = 0; r < mr; r++) {
            s[r] = v_dot8(s[r], w[t], v_acts(qa[r] + u * QU + h * QB + 8 * p, t));
          }
      }
    } else {
      const vec hb = legacy_high(type) ? v_planes(qh + h * 32) : low;
#pragma GCC unroll 2
      for (int p = 0; p < 2; p++) {
        vec v[NV];
        v_pair(qs + h * 128 + p * 64, v);
#pragma GCC unroll 2
        for (int t = 0; t < NV; t++) {
          vec wl = v_and(v[t], low), wh = v_and(v_srli16(v[t], 4), low);
          if (legacy_high(type)) {
            wl = v_or(wl, v_and(v_fifth_low(hb, p, t), bit4));
            wh = v_or(wh, v_and(v_fifth_high(hb, p, t), bit4));
          }
#pragma GCC unroll 8
          for (int r = 0; r < mr; r++) {
            const int8_t* a = qa[r] + u * QU + h * QB + 8 * p;
            s[r] = v_dot(s[r], wl, v_acts(a, t));
            s[r] = v_dot(s[r], wh, v_acts(a + 16, t));
          }
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 16 * h)));
    const __m256 m = legacy_min(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 32 + 16 * h))) : d;
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) {
      const size_t blk = (size_t)(m0 + r) * j->nab + 2 * u + h;
      const float ad = j->ad[blk];
      const int sum = j->bs32[blk];
      __m256i isum = v_columns(s[r]);
      if (zero) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(zero * sum));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(ad)), acc[r]);
      if (legacy_min(type)) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(ad * (float)sum), acc[r]);
    }
  }
}

#endif
