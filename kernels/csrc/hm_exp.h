/* e^x without libm, shared by the CPU kernels (decode_attention.c's softmax, linear.c's SiLU):
 * branch-free, so that loops over it vectorise. */
#ifndef HM_EXP_H
#define HM_EXP_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* The polynomial for 2^f on [-0.5, 0.5], highest degree first, evaluated by Horner's rule at every
 * width from one list: FMA(a, b, c) is a * b + c, SET(c) the constant c at that width. */
#define HM_EXP_POLY(FMA, SET, f)                                                               \
  FMA(FMA(FMA(FMA(FMA(FMA(SET(1.5403530393381609954e-4f), f, SET(1.3333558146428443423e-3f)), \
                      f, SET(9.6181291076284771619e-3f)),                                    \
                  f, SET(5.5504108664821579953e-2f)),                                        \
              f, SET(2.4022650695910071233e-1f)),                                            \
          f, SET(6.9314718055994530942e-1f)),                                                \
      f, SET(1.0f))
#define HM_MULADD(a, b, c) ((a) * (b) + (c))
#define HM_SCALAR(c) (c)

/* e^x for x <= 0 (softmax arguments), branch-free so that loops over it vectorise: 2^(x log2 e)
 * split into an integer power of two and a degree-6 polynomial on [-0.5, 0.5] (relative error
 * below 2e-7); arguments below -87 give 0. */
static inline float hm_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float y = x * 1.44269504088896341f;
  const float n = __builtin_floorf(y + 0.5f); /* inlined (roundf is a libm call) */
  const float f = y - n;
  const float p = HM_EXP_POLY(HM_MULADD, HM_SCALAR, f);
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, 4);
  return x <= -87.0f ? 0.0f : p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
/* hm_exp on eight lanes: the same steps (clamp, split into 2^n and the polynomial, 0 below -87). */
static inline __m256 hm_exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  x = _mm256_min_ps(_mm256_max_ps(x, lowest), _mm256_set1_ps(88.0f)); /* e^88 still a float */
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(y, _mm256_set1_ps(0.5f)));
  const __m256 f = _mm256_sub_ps(y, n);
  const __m256 p = HM_EXP_POLY(_mm256_fmadd_ps, _mm256_set1_ps, f);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lowest, _CMP_LE_OQ), r);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__)
/* hm_exp8 on sixteen lanes in 512-bit registers: the same steps, so the same bits (2^n applied
 * by scalef, exact as hm_exp8's multiply by a power of two). */
static inline __m512 hm_exp16(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.0f);
  x = _mm512_min_ps(_mm512_max_ps(x, lowest), _mm512_set1_ps(88.0f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_floor_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)));
  const __m512 f = _mm512_sub_ps(y, n);
  const __m512 p = HM_EXP_POLY(_mm512_fmadd_ps, _mm512_set1_ps, f);
  const __m512 r = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lowest, _CMP_GT_OQ), r);
}
#endif

#endif
