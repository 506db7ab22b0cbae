/* The vectors BlockMatMul (block_matmul.c) computes with, one set of helpers for each
 * instruction set it is built for: AVX-512 with VNNI (16 int32 lanes, dpbusd) or AVX2
 * (8 lanes, maddubs). The build picks by the compiler's target (-march=native). */
#ifndef HETERO_SD_BLOCK_SIMD_H
#define HETERO_SD_BLOCK_SIMD_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1   /* 16 int32 lanes, VNNI dot products */
#define MM(name) _mm512_##name  /* the width's intrinsic */
enum { VL = 16 };
typedef __m512i ivec;
typedef __m512 fvec;
#else
#define WIDE 0   /* AVX2: 8 int32 lanes, maddubs */
#define MM(name) _mm256_##name
enum { VL = 8 };
typedef __m256i ivec;
typedef __m256 fvec;
#endif

/* the float and int32 lane operations both widths name alike */
#define FMAX(a, b) MM(max_ps)(a, b)
#define FMA(a, b, c) MM(fmadd_ps)(a, b, c)
#define FNMA(a, b, c) MM(fnmadd_ps)(a, b, c)
#define MUL(a, b) MM(mul_ps)(a, b)
#define SUB(a, b) MM(sub_ps)(a, b)
#define CVT(i) MM(cvtepi32_ps)(i)
#define ROUND(f) MM(cvtps_epi32)(f)
#define SET1(x) MM(set1_ps)(x)
#define IADD(a, b) MM(add_epi32)(a, b)

/* the zero points of up to 16 blocks, one byte each; `safe`: 16 of them may be read
 * (lanes past the row's blocks then hold the next column's, which a zero scale masks) */
static inline __m128i zero_bytes(const uint8_t* z, int bits, int n, int safe) {
  __m128i b;
  if (safe) b = bits == 4 ? _mm_loadl_epi64((const __m128i*)z) : _mm_loadu_si128((const __m128i*)z);
  else {
    uint8_t buf[16] = {0};
    memcpy(buf, z, bits == 4 ? (size_t)(n + 1) / 2 : (size_t)n);
    b = _mm_loadu_si128((const __m128i*)buf);
  }
  if (bits == 4) {
    const __m128i m = _mm_set1_epi8(15);
    b = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
  }
  return b;
}

#if WIDE
static inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
static inline fvec fzero(void) { return _mm512_setzero_ps(); }
static inline ivec izero(void) { return _mm512_setzero_si512(); }
static inline float fsum(fvec v) { return _mm512_reduce_add_ps(v); }
static inline int32_t isum(ivec v) { return _mm512_reduce_add_epi32(v); }
static inline fvec fabsv(fvec v) { return _mm512_abs_ps(v); }
static inline float fmaxh(fvec v) { return _mm512_reduce_max_ps(v); }
static inline fvec floadn(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline fvec lanes(const float* p, int n, const int32_t* rel) {  /* p[rel[l]] for each lane */
  return _mm512_permutexvar_ps(_mm512_loadu_si512(rel), floadn(p, n));
}
static inline void evens_odds(const float* x, fvec* e, fvec* o) {
  const fvec a = fload(x), b = fload(x + VL);
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  *e = _mm512_permutex2var_ps(a, ev, b);
  *o = _mm512_permutex2var_ps(a, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), b);
}
static inline void store_i8(int8_t* q, ivec v) { _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(v)); }
static inline ivec dot(ivec acc, ivec w, const int8_t* a) { return _mm512_dpbusd_epi32(acc, w, _mm512_loadu_si512(a)); }
static inline ivec dot8(ivec acc, ivec w, const int8_t* a) { return dot(acc, w, a); }
static inline void load4(const uint8_t* p, int tail, ivec* lo, ivec* hi) {
  const __m512i m = _mm512_set1_epi8(15);
  const __m512i v = tail ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)p)) : _mm512_loadu_si512(p);
  *lo = _mm512_and_si512(v, m);
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
}
static inline ivec load8(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline fvec zeros_of(const uint8_t* z, int bits, int n, int safe) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(zero_bytes(z, bits, n, safe)));
}
#else
static inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
static inline fvec fzero(void) { return _mm256_setzero_ps(); }
static inline ivec izero(void) { return _mm256_setzero_si256(); }
static inline float fsum(fvec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline int32_t isum(ivec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
static inline fvec fabsv(fvec v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline float fmaxh(fvec v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
static inline fvec floadn(const float* p, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}
static inline fvec lanes(const float* p, int n, const int32_t* rel) {
  return _mm256_permutevar8x32_ps(floadn(p, n), _mm256_loadu_si256((const __m256i*)rel));
}
static inline void evens_odds(const float* x, fvec* e, fvec* o) {
  const fvec a = fload(x), b = fload(x + VL);
  *e = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  *o = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}
static inline void store_i8(int8_t* q, ivec v) {
  const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64((__m128i*)q, _mm_packs_epi16(p, p));
}
/* maddubs: unsigned x signed bytes into saturating int16 pairs; a 4-bit weight is small enough */
static inline ivec dot(ivec acc, ivec w, const int8_t* a) {
  const __m256i p = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i*)a));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
/* an 8-bit weight goes as |w - 128| against a carrying its sign (llama.cpp's trick): the
 * zero point 128 is applied here, so the correction takes z - 128 */
static inline ivec dot8(ivec acc, ivec w, const int8_t* a) {
  const __m256i x = _mm256_loadu_si256((const __m256i*)a), s = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(x, s));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline void load4(const uint8_t* p, int tail, ivec* lo, ivec* hi) {
  (void)tail;
  const __m256i m = _mm256_set1_epi8(15), v = _mm256_loadu_si256((const __m256i*)p);
  *lo = _mm256_and_si256(v, m);
  *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}
static inline ivec load8(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline fvec zeros_of(const uint8_t* z, int bits, int n, int safe) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(zero_bytes(z, bits, n, safe)));
}
#endif


#endif
