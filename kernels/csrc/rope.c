/* Rotary position embedding in place, rotate-half layout (as HF's Llama): for each row n and head
 * h, with x1, x2 the halves of x[n][h] and c, s = cos[n], sin[n] (D/2 each),
 *   x1' = x1 c - x2 s,   x2' = x2 c + x1 s.
 * Why C: as torch ops it is four products, two sums and a concatenation per call, each a pass
 * over q and k with a temporary, and a parallel region each (a prefill forward's barrier count
 * matters on a shared 2-core host). bf16 rounds after each product and each sum, as the
 * reference's bf16 ops do, so the results are the same bits. */

#include <stdint.h>

#include "hm_kernels.h"
#include "hm_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* 16 lanes at a time, for halves that are a multiple of 16 (head_dim 32, 64, 128, ...). Why: one
 * lane at a time a 1,024-token prefill of SmolLM2 spent 0.25 ms a layer here (7.5 ms of a
 * 234 ms forward on a 2-core AMX Xeon); 16 lanes take 0.09. The roundings are the scalar
 * path's (nearest even; the instruction flushes values below bf16's normal range to zero, as
 * the matmuls' own conversions do). */
#define HM_ROPE_VEC 16
#endif

enum { HM_ROPE_F32 = 0, HM_ROPE_BF16 = 1 };

/* x: rows [n][heads][d] (row stride ldx, head stride ldh, elements), cos/sin [n][d/2] in x's
 * dtype. */
void hm_rope(void *x, int64_t ldx, int64_t ldh, int rows, int heads, int d, const void *cos,
             const void *sin, int dtype, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 64) schedule(static)
  for (int n = 0; n < rows; n++) hm_rope_row(x, ldx, ldh, n, heads, d, cos, sin, dtype);
}

/* Row n of hm_rope's x, on the calling thread. */
void hm_rope_row(void *x, int64_t ldx, int64_t ldh, int n, int heads, int d, const void *cos,
                 const void *sin, int dtype) {
  const int half = d / 2;
  for (int h = 0; h < heads; h++) {
    if (dtype == HM_ROPE_F32) {
      float *a = (float *)x + n * ldx + h * ldh, *b = a + half;
      const float *c = (const float *)cos + (int64_t)n * half;
      const float *s = (const float *)sin + (int64_t)n * half;
#pragma omp simd
      for (int i = 0; i < half; i++) {
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * c[i] - x2 * s[i];
        b[i] = x2 * c[i] + x1 * s[i];
      }
    } else {
      uint16_t *a = (uint16_t *)x + n * ldx + h * ldh, *b = a + half;
      const uint16_t *c = (const uint16_t *)cos + (int64_t)n * half;
      const uint16_t *s = (const uint16_t *)sin + (int64_t)n * half;
      int i0 = 0;
#ifdef HM_ROPE_VEC
      for (; i0 + HM_ROPE_VEC <= half; i0 += HM_ROPE_VEC) {
        const __m512 x1 = hm_bf16_to_ps(a + i0), x2 = hm_bf16_to_ps(b + i0);
        const __m512 ci = hm_bf16_to_ps(c + i0), si = hm_bf16_to_ps(s + i0);
        hm_store_bf16(a + i0, _mm512_sub_ps(hm_round_ps(_mm512_mul_ps(x1, ci)),
                                            hm_round_ps(_mm512_mul_ps(x2, si))));
        hm_store_bf16(b + i0, _mm512_add_ps(hm_round_ps(_mm512_mul_ps(x2, ci)),
                                            hm_round_ps(_mm512_mul_ps(x1, si))));
      }
#endif
      for (int i = i0; i < half; i++) {
        const float x1 = hm_bf16_scalar(a[i]), x2 = hm_bf16_scalar(b[i]);
        const float ci = hm_bf16_scalar(c[i]), si = hm_bf16_scalar(s[i]);
        a[i] = hm_round_bf16(hm_bf16_round(x1 * ci) - hm_bf16_round(x2 * si));
        b[i] = hm_round_bf16(hm_bf16_round(x2 * ci) + hm_bf16_round(x1 * si));
      }
    }
  }
}
