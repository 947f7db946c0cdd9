/* bf16 <-> fp32 one value at a time, shared by the CPU kernels (bf16 is fp32's top 16 bits). */
#ifndef HM_BF16_H
#define HM_BF16_H

#include <stdint.h>
#include <string.h>

static inline float hm_bf16_scalar(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* fp32 -> bf16, round to nearest even (as torch's conversion; NaN kept a NaN). */
static inline uint16_t hm_round_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* f rounded to bf16, as fp32 */
static inline float hm_bf16_round(float f) { return hm_bf16_scalar(hm_round_bf16(f)); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
/* The same 16 lanes at a time (the conversion rounds to nearest even and flushes values below
 * bf16's normal range to zero). */
static inline __m512 hm_bf16_to_ps(const uint16_t *src) {
  const __m256i v = _mm256_loadu_si256((const __m256i *)src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline __m512 hm_round_ps(__m512 v) { /* v rounded to bf16, back in fp32 */
  const __m256bh h = _mm512_cvtneps_pbh(v);
  __m256i bits;
  memcpy(&bits, &h, sizeof bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

static inline void hm_store_bf16(uint16_t *dst, __m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  memcpy(dst, &h, sizeof h);
}
#endif

#endif
