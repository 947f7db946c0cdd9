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

#endif
