/* y = x W^T on the CPU (fp32, AVX2 + FMA) against a weight packed into panels of 16 outputs.
 *
 * Why: a decode step multiplies a few rows (its batch) by every weight of the model once, so its
 * time is the weights' read plus the arithmetic on them. torch's dense path (MKL sgemm) and
 * oneDNN's packed path both fall well short of either bound at 1-32 rows on an AVX2 CPU; this
 * kernel streams each weight once, at the memory's pace, and keeps the FMA units busy while it
 * does (measured in kernels/packed_linear.py's docstring).
 *
 * Layout: W [N, K] (N a multiple of 16) is held as panels P[N/16][K][16]: panel p, row k holds
 * W[16p .. 16p+15][k], 64 bytes, one cache line. A panel (K x 64 bytes) is read front to back,
 * once from memory for the first six rows of x and from cache for the rest, while the next
 * panel is prefetched: one line of it per k, so it arrives as this one is worked on.
 *
 * Micro-kernel: MR rows of x (MR <= 6) by one panel, 2 x MR accumulators of 8 lanes in
 * registers (12 of the 16 ymm registers at MR = 6): per k, two loads of the panel's line, one
 * broadcast of x[r][k] per row and 2 x MR fused multiply-adds. Threads take whole panels.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "hm_kernels.h"
#include "hm_exp.h"

#define HM_NR 16 /* outputs per panel */
#define HM_MR 6  /* rows of x per micro-kernel call */
/* Element-wise steps split rows among threads from this many rows up (a prefill chunk); a decode
 * batch's few rows cost less than waking the threads. */
#define HM_PARALLEL_ROWS 64
#ifndef HM_X_BLOCK_BYTES
#define HM_X_BLOCK_BYTES (192 * 1024) /* rows of x worked on at once: about half an L2 */
#endif

/* panels[N/16][K][16] from w [N, K] (row-major). */
void hm_linear_pack(const float *w, int n, int k, float *panels, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < n / HM_NR; p++)
    for (int kk = 0; kk < k; kk++)
      for (int j = 0; j < HM_NR; j++)
        panels[((int64_t)p * k + kk) * HM_NR + j] = w[((int64_t)p * HM_NR + j) * k + kk];
}

#if defined(__AVX2__) && defined(__FMA__)
/* One row of x (MR > r) against the panel's line at k: two fused multiply-adds. */
#define HM_ROW_STEP(MR, r)                                           \
  if ((MR) > (r)) {                                                  \
    const __m256 xb = _mm256_broadcast_ss(x + (r) * ldx + kk);       \
    a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);                      \
    a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);                      \
  }
#define HM_ROW_STORE(MR, r)                                          \
  if ((MR) > (r)) {                                                  \
    _mm256_storeu_ps(out + (r) * ldo, a##r##0);                      \
    _mm256_storeu_ps(out + (r) * ldo + 8, a##r##1);                  \
  }
/* MR rows of x [.., K] (row stride ldx) times one panel into out (row stride ldo), added to what
 * out holds when `add`; `next`: the panel to prefetch a line of per k, or NULL. Named
 * accumulators, so that they stay in registers (an array of them is spilled to the stack on
 * every k). */
#define HM_ROW_LOAD(MR, r)                                           \
  if ((MR) > (r) && add) {                                           \
    a##r##0 = _mm256_loadu_ps(out + (r) * ldo);                      \
    a##r##1 = _mm256_loadu_ps(out + (r) * ldo + 8);                  \
  }
#define HM_MICRO(MR)                                                                          \
  static void hm_micro##MR(const float *x, int64_t ldx, const float *panel, int k,           \
                           float *out, int64_t ldo, const float *next, int add) {            \
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;  \
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;                 \
    HM_ROW_LOAD(MR, 0) HM_ROW_LOAD(MR, 1) HM_ROW_LOAD(MR, 2)                                  \
    HM_ROW_LOAD(MR, 3) HM_ROW_LOAD(MR, 4) HM_ROW_LOAD(MR, 5)                                  \
    for (int kk = 0; kk < k; kk++) {                                                          \
      const __m256 w0 = _mm256_load_ps(panel + (int64_t)kk * HM_NR);                          \
      const __m256 w1 = _mm256_load_ps(panel + (int64_t)kk * HM_NR + 8);                      \
      if (next) _mm_prefetch((const char *)(next + (int64_t)kk * HM_NR), _MM_HINT_T0);        \
      HM_ROW_STEP(MR, 0) HM_ROW_STEP(MR, 1) HM_ROW_STEP(MR, 2)                                \
      HM_ROW_STEP(MR, 3) HM_ROW_STEP(MR, 4) HM_ROW_STEP(MR, 5)                                \
    }                                                                                         \
    HM_ROW_STORE(MR, 0) HM_ROW_STORE(MR, 1) HM_ROW_STORE(MR, 2)                               \
    HM_ROW_STORE(MR, 3) HM_ROW_STORE(MR, 4) HM_ROW_STORE(MR, 5)                               \
  }
HM_MICRO(1)
HM_MICRO(2)
HM_MICRO(3)
HM_MICRO(4)
HM_MICRO(5)
HM_MICRO(6)

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times the panels' W^T, or out += that
 * when `add` (a residual connection in the same pass). The panels must be 32-byte aligned.
 * Returns 0 (1: built without AVX2/FMA, nothing written). */
int hm_linear(const float *x, int64_t ldx, int m, const float *panels, int n, int k, float *out,
              int64_t ldo, int add, int threads) {
  const int np = n / HM_NR;
  /* Rows in blocks that stay in the L2 cache while every panel passes over them (a prefill
   * chunk's rows would otherwise come from L3 again for each panel). */
  int mb = (int)(HM_X_BLOCK_BYTES / ((int64_t)k * 4)) / HM_MR * HM_MR;
  mb = mb < HM_MR ? HM_MR : mb;
  for (int m0 = 0; m0 < m; m0 += mb) {
    const int rows = m - m0 < mb ? m - m0 : mb;
    const float *xb = x + (int64_t)m0 * ldx;
    float *ob = out + (int64_t)m0 * ldo;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int p = 0; p < np; p++) {
      const float *panel = panels + (int64_t)p * k * HM_NR;
      const float *next = p + 1 < np ? panel + (int64_t)k * HM_NR : NULL;
      float *o = ob + (int64_t)p * HM_NR;
      int r = 0;
      for (; r + HM_MR <= rows; r += HM_MR, next = NULL) /* the first pass prefetches */
        hm_micro6(xb + r * ldx, ldx, panel, k, o + r * ldo, ldo, next, add);
      switch (rows - r) {
        case 1: hm_micro1(xb + r * ldx, ldx, panel, k, o + r * ldo, ldo, next, add); break;
        case 2: hm_micro2(xb + r * ldx, ldx, panel, k, o + r * ldo, ldo, next, add); break;
        case 3: hm_micro3(xb + r * ldx, ldx, panel, k, o + r * ldo, ldo, next, add); break;
        case 4: hm_micro4(xb + r * ldx, ldx, panel, k, o + r * ldo, ldo, next, add); break;
        case 5: hm_micro5(xb + r * ldx, ldx, panel, k, o + r * ldo, ldo, next, add); break;
        default: break;
      }
    }
  }
  return 0;
}
#else
int hm_linear(const float *x, int64_t ldx, int m, const float *panels, int n, int k, float *out,
              int64_t ldo, int add, int threads) {
  (void)x, (void)ldx, (void)m, (void)panels, (void)n, (void)k, (void)out, (void)ldo, (void)add;
  (void)threads;
  return 1;
}
#endif

/* 1 when hm_linear was built with its AVX2 + FMA path. */
int hm_linear_available(void) {
#if defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

/* ---- the element-wise steps around a decode step's matmuls, one pass each ----
 * At decode batch sizes each is a few microseconds of arithmetic; as torch ops (RMSNorm's
 * square, mean, rsqrt and two products; SiLU then a product; a residual add) each costs several
 * dispatches and temporaries. */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for `rows` rows of `dim` (row strides ldx,
 * ldo). */
void hm_rms_norm(const float *x, int64_t ldx, int rows, int dim, const float *w, float eps,
                 float *out, int64_t ldo, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= HM_PARALLEL_ROWS) schedule(static)
  for (int r = 0; r < rows; r++) {
    const float *xr = x + r * ldx;
    float *o = out + r * ldo;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
  }
}

/* out[r][i] = silu(gu[r][i]) * gu[r][inter + i]: SwiGLU's gate and up halves of one matmul. */
void hm_silu_mul(const float *gu, int64_t ldg, int rows, int inter, float *out, int64_t ldo,
                 int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= HM_PARALLEL_ROWS) schedule(static)
  for (int r = 0; r < rows; r++) {
    const float *g = gu + r * ldg, *u = g + inter;
    float *o = out + r * ldo;
    int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= inter; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = hm_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                            _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}
