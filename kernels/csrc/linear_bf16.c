/* y = x W^T on the CPU in bf16 (AVX-512 BF16), against a weight packed into panels of 16
 * outputs: linear.c's panels, for the CPUs whose fast dtype is bf16.
 *
 * Why: at decode batch sizes (1-32 rows) oneDNN's packed bf16 path runs well below the memory
 * bound at one row and below the arithmetic bound at sixteen (kernels/packed_linear.py has the
 * figures); this kernel streams each weight once and spends one `vdpbf16ps` (32 multiply-adds)
 * per row per 64-byte line.
 *
 * Layout: W [N, K] (N a multiple of 16, K even) is held as panels P[N/16][K/2][16][2]: panel p,
 * line kp holds W[16p + j][2kp + t] at [j][t], 64 bytes. `vdpbf16ps` multiplies a line by one
 * pair (x[r][2kp], x[r][2kp + 1]) broadcast to every lane and adds both products into 16 fp32
 * accumulators, so x stays bf16 and the sums are fp32 (as oneDNN's bf16 matmul). The output is
 * rounded to bf16 once, after the residual (if any) is added in fp32.
 */

#define _GNU_SOURCE /* syscall(): asking the kernel for the AMX tile state */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include "hm_kernels.h"
#include "hm_bf16.h"
#include "hm_exp.h"
#include "hm_amx.h"
#include <omp.h>

#define HM_NR 16 /* outputs per panel */
/* Element-wise steps split rows among threads from this many rows up. Below it a row costs less
 * than a parallel region. At 16 rows, in a decode step whose threads are already awake, the
 * two RMSNorms ran on one thread while the other waited (each norm ~9 us of a layer's ~450). */
#define HM_PARALLEL_ROWS 8
/* Rows of x per micro-kernel call: 16 accumulators (of 32 registers), so a decode batch of 16
 * streams each panel from memory once, one `vdpbf16ps` per row per line loaded. Against 8 rows
 * a call (each panel streamed twice), on a 2-core AVX-512 BF16 CPU without AMX, 16 rows took
 * 0.76 of the time for SmolLM2's LM head (3.4 against 4.5 ms) and 0.91-0.94 for a layer's
 * projections; 1-8 rows the same. */
#define HM_MR 16
/* How far ahead in its stream of panels (each thread's are contiguous) a micro-kernel prefetches,
 * into L2. On a 2-core AVX-512 BF16 CPU without AMX, SmolLM2's 30 layers and LM head at 16 rows
 * (weights from memory): ~15.3 ms with the next panel's line prefetched into L1 (the old way),
 * 13.6-14.0 ms 8-32 KB ahead into L2, 18.4 ms with no prefetch. */
#ifndef HM_PREFETCH_BYTES
#define HM_PREFETCH_BYTES (16 * 1024)
#endif
/* Rows up to which x is packed by 16s for the micro-kernel's broadcasts (see hm_linear_bf16) */
#define HM_PACK_X_ROWS 64
#ifndef HM_X_BLOCK_BYTES
#define HM_X_BLOCK_BYTES (192 * 1024) /* rows of x worked on at once: about half an L2 */
#endif

/* panels[N/16][K/2][16][2] from w [N, K] (row-major bf16 bits). */
void hm_linear_bf16_pack(const uint16_t *w, int n, int k, uint16_t *panels, int threads) {
  const int kh = k / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < n / HM_NR; p++)
    for (int kp = 0; kp < kh; kp++)
      for (int j = 0; j < HM_NR; j++)
        for (int t = 0; t < 2; t++)
          panels[(((int64_t)p * kh + kp) * HM_NR + j) * 2 + t] =
              w[((int64_t)p * HM_NR + j) * k + 2 * kp + t];
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16(bf16(silu(g)) * u) of 16 lanes of bf16 values g and u (held in fp32), as the reference's
 * two ops round: SwiGLU's step, whether it reads gate/up from memory or from the matmul. */
static inline __m512 hm_silu_mul16(__m512 g, __m512 u) {
  const __m512 e = hm_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(hm_round_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e))), u);
}

/* The pair x[r][2kp], x[r][2kp + 1] in every 32-bit lane. */
static inline __m512bh hm_pair(const uint16_t *xr, int kp) {
  int32_t pair;
  memcpy(&pair, xr + 2 * kp, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

#define HM_ROW_LOAD(MR, r) \
  if ((MR) > (r) && add) a##r = hm_bf16_to_ps(out + (r) * ldo);
#define HM_ROW_STEP(MR, r) \
  if ((MR) > (r)) a##r = _mm512_dpbf16_ps(a##r, hm_pair(x + (r) * ldx, kp), wv);
#define HM_ROW_STORE(MR, r)                                                  \
  if ((MR) > (r)) {                                                          \
    const __m256bh o = _mm512_cvtneps_pbh(a##r);                             \
    memcpy(out + (r) * ldo, &o, sizeof o);                                   \
  }
/* MR rows of x [.., K] (row stride ldx) times one panel into out (row stride ldo), added to
 * what out holds when `add`; `ahead`: whether to prefetch a line per kp, HM_PREFETCH_BYTES on in
 * the same thread's stream of panels (an address that may lie past the weights' end: a prefetch
 * never faults, and the address is computed as an integer). Named
 * accumulators, so that they stay in registers. */
#define HM_MICRO(MR) \
  static void hm_micro_bf16_##MR(const uint16_t *x, int64_t ldx, const uint16_t *panel, \
                                 int kh, uint16_t *out, int64_t ldo, int ahead, \
                                 int add) { \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0; \
    __m512 a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0; \
    __m512 a15 = a0; \
    HM_ROW_LOAD(MR, 0) HM_ROW_LOAD(MR, 1) HM_ROW_LOAD(MR, 2) HM_ROW_LOAD(MR, 3) \
    HM_ROW_LOAD(MR, 4) HM_ROW_LOAD(MR, 5) HM_ROW_LOAD(MR, 6) HM_ROW_LOAD(MR, 7) \
    HM_ROW_LOAD(MR, 8) HM_ROW_LOAD(MR, 9) HM_ROW_LOAD(MR, 10) HM_ROW_LOAD(MR, 11) \
    HM_ROW_LOAD(MR, 12) HM_ROW_LOAD(MR, 13) HM_ROW_LOAD(MR, 14) HM_ROW_LOAD(MR, 15) \
    for (int kp = 0; kp < kh; kp++) { \
      const __m512bh wv = (__m512bh)_mm512_load_si512(panel + (int64_t)kp * 2 * HM_NR); \
      if (ahead) \
        _mm_prefetch((const char *)((uintptr_t)(panel + (int64_t)kp * 2 * HM_NR) + \
                                    HM_PREFETCH_BYTES), \
                     _MM_HINT_T1); \
      HM_ROW_STEP(MR, 0) HM_ROW_STEP(MR, 1) HM_ROW_STEP(MR, 2) HM_ROW_STEP(MR, 3) \
      HM_ROW_STEP(MR, 4) HM_ROW_STEP(MR, 5) HM_ROW_STEP(MR, 6) HM_ROW_STEP(MR, 7) \
      HM_ROW_STEP(MR, 8) HM_ROW_STEP(MR, 9) HM_ROW_STEP(MR, 10) HM_ROW_STEP(MR, 11) \
      HM_ROW_STEP(MR, 12) HM_ROW_STEP(MR, 13) HM_ROW_STEP(MR, 14) HM_ROW_STEP(MR, 15) \
    } \
    HM_ROW_STORE(MR, 0) HM_ROW_STORE(MR, 1) HM_ROW_STORE(MR, 2) HM_ROW_STORE(MR, 3) \
    HM_ROW_STORE(MR, 4) HM_ROW_STORE(MR, 5) HM_ROW_STORE(MR, 6) HM_ROW_STORE(MR, 7) \
    HM_ROW_STORE(MR, 8) HM_ROW_STORE(MR, 9) HM_ROW_STORE(MR, 10) HM_ROW_STORE(MR, 11) \
    HM_ROW_STORE(MR, 12) HM_ROW_STORE(MR, 13) HM_ROW_STORE(MR, 14) HM_ROW_STORE(MR, 15) \
  }
HM_MICRO(1)
HM_MICRO(2)
HM_MICRO(3)
HM_MICRO(4)
HM_MICRO(5)
HM_MICRO(6)
HM_MICRO(7)
HM_MICRO(8)
HM_MICRO(9)
HM_MICRO(10)
HM_MICRO(11)
HM_MICRO(12)
HM_MICRO(13)
HM_MICRO(14)
HM_MICRO(15)
HM_MICRO(16)

typedef void (*hm_micro_bf16_fn)(const uint16_t *, int64_t, const uint16_t *, int, uint16_t *,
                                 int64_t, int, int);
static const hm_micro_bf16_fn hm_micros_bf16[HM_MR + 1] = {
    NULL, hm_micro_bf16_1, hm_micro_bf16_2, hm_micro_bf16_3, hm_micro_bf16_4, hm_micro_bf16_5,
    hm_micro_bf16_6, hm_micro_bf16_7, hm_micro_bf16_8, hm_micro_bf16_9, hm_micro_bf16_10,
    hm_micro_bf16_11, hm_micro_bf16_12, hm_micro_bf16_13, hm_micro_bf16_14, hm_micro_bf16_15,
    hm_micro_bf16_16,
};

/* hm_micro_bf16_16 over 16 rows of x packed as xp[kp][16] (row r's pair kp at xp[16 kp + r]):
 * every broadcast is one base register and an offset, where 16 row pointers (x + r ldx) did not
 * fit the registers and were reloaded from the stack each step. */
#define HM_XSTEP(r) a##r = _mm512_dpbf16_ps(a##r, wv, (__m512bh)_mm512_set1_epi32(xk[r]));
#define HM_XLOAD(r) \
  if (add) a##r = hm_bf16_to_ps(out + (r) * ldo); /* the residual first, as HM_ROW_LOAD */
#define HM_XSTORE(r)                              \
  {                                               \
    const __m256bh o = _mm512_cvtneps_pbh(a##r);  \
    memcpy(out + (r) * ldo, &o, sizeof o);        \
  }
static void hm_micro_bf16_x16(const int32_t *xp, const uint16_t *panel, int kh, uint16_t *out,
                              int64_t ldo, int ahead, int add) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0;
  __m512 a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0;
  __m512 a15 = a0;
  HM_XLOAD(0) HM_XLOAD(1) HM_XLOAD(2) HM_XLOAD(3) HM_XLOAD(4) HM_XLOAD(5) HM_XLOAD(6)
  HM_XLOAD(7) HM_XLOAD(8) HM_XLOAD(9) HM_XLOAD(10) HM_XLOAD(11) HM_XLOAD(12) HM_XLOAD(13)
  HM_XLOAD(14) HM_XLOAD(15)
  for (int kp = 0; kp < kh; kp++) {
    const __m512bh wv = (__m512bh)_mm512_load_si512(panel + (int64_t)kp * 2 * HM_NR);
    if (ahead)
      _mm_prefetch((const char *)((uintptr_t)(panel + (int64_t)kp * 2 * HM_NR) +
                                  HM_PREFETCH_BYTES),
                   _MM_HINT_T1);
    const int32_t *xk = xp + (int64_t)kp * 16;
    HM_XSTEP(0) HM_XSTEP(1) HM_XSTEP(2) HM_XSTEP(3) HM_XSTEP(4) HM_XSTEP(5) HM_XSTEP(6)
    HM_XSTEP(7) HM_XSTEP(8) HM_XSTEP(9) HM_XSTEP(10) HM_XSTEP(11) HM_XSTEP(12) HM_XSTEP(13)
    HM_XSTEP(14) HM_XSTEP(15)
  }
  HM_XSTORE(0) HM_XSTORE(1) HM_XSTORE(2) HM_XSTORE(3) HM_XSTORE(4) HM_XSTORE(5) HM_XSTORE(6)
  HM_XSTORE(7) HM_XSTORE(8) HM_XSTORE(9) HM_XSTORE(10) HM_XSTORE(11) HM_XSTORE(12)
  HM_XSTORE(13) HM_XSTORE(14) HM_XSTORE(15)
}
#undef HM_XLOAD
#undef HM_XSTEP
#undef HM_XSTORE

/* A calling thread's scratch of at least `bytes` (64-byte aligned), grown as needed and never
 * freed: *buf and *have are that thread's. NULL when there is no memory. */
static void *hm_scratch(void **buf, size_t *have, size_t bytes) {
  if (bytes > *have) {
    void *grown = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!grown) return NULL;
    free(*buf);
    *buf = grown;
    *have = bytes;
  }
  return *buf;
}

/* Scratch for x packed by 16 rows, and for two blocks of x at a padded stride (below): the
 * calling thread's, shared by its parallel region's threads. */
static _Thread_local void *hm_xp, *hm_xpad;
static _Thread_local size_t hm_xp_bytes, hm_xpad_bytes;

/* The calling thread's scratch for m rows of K = 2 kh inputs packed by 16s, or NULL where they
 * go unpacked: more than HM_PACK_X_ROWS rows (a prefill's thousands: packing cost more than it
 * gained), none whole, or no memory. */
static int32_t *hm_x_scratch(int m, int kh) {
  const size_t words = m <= HM_PACK_X_ROWS ? (size_t)(m / 16) * kh * 16 : 0;
  return words ? (int32_t *)hm_scratch(&hm_xp, &hm_xp_bytes, words * 4) : NULL;
}

/* Where x's rows lie a multiple of 2 KiB apart (K = 1,024, 2,048, 4,096, ...: the hidden sizes
 * of most Llama-family models, though not SmolLM2's 576), the 16 rows a micro-kernel step reads
 * fall in one or two of the L1's 64 sets (4 KiB a way on AMD's and Intel's cores alike) and,
 * with the panel's lines, evict each other every step. On a 2-core AVX-512 BF16 EPYC, 1,024 rows
 * times a [8,192, 2,048] weight ran at 180 GFLOP/s against 390-430 at K = 2,064; 12 or 15 rows at
 * 190-260 against 390-430. There the rows read as they lie go through a copy whose stride is one
 * line longer, a block at a time. */
static int hm_x_aliases(int64_t ldx) { return (ldx * 2) % 2048 == 0; }

/* x's whole 16-row groups into xp (xp[(g kh + kp) 16 + r] = row 16 g + r's pair kp), a run of
 * kp on each thread of the enclosing parallel region; its threads wait for each other at the
 * end. */
static void hm_pack_x(const uint16_t *x, int64_t ldx, int m, int kh, int32_t *xp) {
#pragma omp for schedule(static)
  for (int kp = 0; kp < kh; kp++)
    for (int g = 0; g < m / 16; g++) {
      int32_t *dst = xp + ((size_t)g * kh + kp) * 16;
      for (int r = 0; r < 16; r++) memcpy(dst + r, x + (int64_t)(16 * g + r) * ldx + 2 * kp, 4);
    }
}

/* mr rows of x from row r0 (at xr) times one panel: from the packed rows where they are (a
 * whole group of 16 in xp), else as x lies. */
static inline void hm_micro_rows(const int32_t *xp, int r0, int mr, const uint16_t *xr,
                                 int64_t ldx, const uint16_t *panel, int kh, uint16_t *out,
                                 int64_t ldo, int ahead, int add) {
  if (xp && mr == 16)
    hm_micro_bf16_x16(xp + (size_t)(r0 / 16) * kh * 16, panel, kh, out, ldo, ahead, add);
  else
    hm_micros_bf16[mr](xr, ldx, panel, kh, out, ldo, ahead, add);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX: a panel's lines are already the B operand of `tdpbf16ps` (16 lines of 64 bytes: 32
 * inputs' pairs for 16 outputs), and 16 rows of x, 32 inputs each, read in place, the A operand.
 * One instruction does 16 x 16 x 32 multiply-adds, ~16x a `vdpbf16ps`: at 8 or more rows the
 * dot-product path above is bound by its arithmetic, the tiles are not. Two panels share each
 * A tile. Tiles: 0, 1 accumulate (fp32 16 x 16), 2 holds x, 3 and 4 the two panels' lines.
 * From 32 rows, two A tiles go against the same two panels (four accumulators), so each tile
 * loaded feeds two products: on a 2-core Xeon with AMX (480 MB L3), 1,024 rows of SmolLM2's
 * gate/up took 2.16 against 2.52 ms (oneDNN 1.49), down 1.22 against 1.33 (oneDNN 1.60), a
 * whole 1,024-token prefill 310 against 328 ms. (An earlier CPU measured that shape slower: 700
 * against 1,050 GFLOP/s at 512 rows.) */
#define HM_AMX_K 32 /* inputs per tile step */
/* Rows of x a thread takes through all of its panels before the next rows (the same panels
 * each time: a static split, so no thread waits for the other between blocks). Why: a panel
 * pair walked down every row wrote a row's 32 or 64 bytes and went on to a line thousands of
 * bytes on, so with 1,024 rows (3-6 MB of output) the lines had left the L2 before the rows
 * came back for them (with SwiGLU, for the other half of each line): the stores, not the
 * tiles, set the pace (without the stores the tiles ran gate/up at 3.1 TFLOP/s, with them
 * 1.65). 256 rows keep a thread's share of the output (768 KB for gate/up) in its L2. Each row
 * of a pair's 32 columns also goes out as one 64-byte store. On the 2-core AMX Xeon, 1,024
 * rows of SmolLM2's layer (QKV, O + residual, gate/up + SwiGLU, down + residual) took
 * 3.47-3.53 against 3.99 ms, 2,048 rows 6.9 against 11.2; 512 rows (two blocks) the same;
 * 128-row blocks measured alike, 64 slower.
 * A 32-row strip's epilogue (rounding, SwiGLU's e^x and divide, the stores and the misses they
 * take) runs during the next strip's tile steps, a few rows a step, instead of between them: the
 * tile unit and the AVX-512 units then work at once, where a strip's tiles used to wait for the
 * previous strip's epilogue (without any epilogue the tiles ran gate/up in 1.2-1.3 ms, with it
 * 1.8). On the 2-core AMX Xeon at 1,024 rows, gate/up + SwiGLU 1.78-1.85 -> 1.43-1.53 ms, QKV
 * 0.51-0.53 -> 0.41-0.44, down 0.76-0.83 -> 0.63-0.68 (medians of 40, three alternating runs);
 * the same bits. */
#define HM_AMX_BLOCK_ROWS 256
/* From this many rows the threads split x's rows (each thread all the panels over its rows),
 * below it the panels (each thread its panels over every row). Why: a prefill's layer is a
 * chain of steps over the same rows, and the element-wise ones between the matmuls (RMSNorm,
 * rotary embedding) split rows too; rows a thread wrote are then in its own core's cache when
 * it reads them next, where with the panels split each row came half from the other core. Each
 * thread reads every weight, which a short prompt's matmuls (and a decode step's) cannot
 * afford. On the 2-core AMX Xeon, SmolLM2's bf16 prefill forward: 1,024 tokens 178-180 ->
 * 165-174 ms, 512 tokens 92.5 -> 89-90, 2,048 tokens 420-427 -> 401-422; 256 tokens went
 * 49-50 -> 56-58, so those keep the panels split. */
#define HM_AMX_SPLIT_ROWS 512

static void hm_amx_config(int rows) {
  hm_tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 5; t++) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = (uint8_t)rows; /* accumulators and x: `rows` */
  cfg.rows[3] = cfg.rows[4] = 16;                          /* a panel's 16 lines */
  hm_tile_loadconfig(&cfg);
}

/* Every tile 16 x 64 bytes: 0-3 accumulate 32 rows x 2 panels, 4 and 5 hold x's two row
 * blocks, 6 and 7 the two panels' lines. */
static void hm_amx_config_2x2(void) {
  hm_tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  hm_tile_loadconfig(&cfg);
}

/* acc (rows x 16 fp32, row stride 16) into out's 16 columns (row stride ldo), added to what out
 * holds when `add`, rounded to bf16 once. */
static void hm_amx_store(const float *acc, int rows, uint16_t *out, int64_t ldo, int add) {
  for (int r = 0; r < rows; r++) {
    __m512 v = _mm512_loadu_ps(acc + r * 16);
    if (add) v = _mm512_add_ps(v, hm_bf16_to_ps(out + r * ldo));
    const __m256bh o = _mm512_cvtneps_pbh(v);
    memcpy(out + r * ldo, &o, sizeof o);
  }
}

/* A pair's two accumulators (rows x 16 fp32 each) into out: SwiGLU's step of gate and up (each
 * rounded to bf16 first, as the unfused matmul writes them) into 16 columns when `silu`, else
 * the two panels' 16 columns each (the second where `two`). */
static void hm_amx_emit(const float *a0, const float *a1, int rows, uint16_t *out, int64_t ldo,
                        int add, int two, int silu) {
  if (silu) {
    for (int r = 0; r < rows; r++) {
      const __m512 g = hm_round_ps(_mm512_loadu_ps(a0 + r * 16));
      hm_store_bf16(out + r * ldo, hm_silu_mul16(g, hm_round_ps(_mm512_loadu_ps(a1 + r * 16))));
    }
    return;
  }
  if (!two) {
    hm_amx_store(a0, rows, out, ldo, add);
    return;
  }
  for (int r = 0; r < rows; r++) { /* a row's 32 columns: one 64-byte store */
    __m512 v0 = _mm512_loadu_ps(a0 + r * 16), v1 = _mm512_loadu_ps(a1 + r * 16);
    if (add) {
      v0 = _mm512_add_ps(v0, hm_bf16_to_ps(out + r * ldo));
      v1 = _mm512_add_ps(v1, hm_bf16_to_ps(out + r * ldo + HM_NR));
    }
    const __m512bh o = _mm512_cvtne2ps_pbh(v1, v0);
    memcpy(out + r * ldo, &o, sizeof o);
  }
}

/* A 32-row strip whose accumulators (acc[0], acc[1]: rows 0-15 of the pair's two panels;
 * acc[2], acc[3]: rows 16-31) wait for their epilogue into out (row stride ldo); `done` rows
 * of it are out. */
typedef struct {
  const float (*acc)[16 * 16];
  uint16_t *out;
  int done;
} hm_amx_pending;

/* Up to n more of the pending strip's rows out (hm_amx_emit's work, a row at a time). */
static inline void hm_amx_emit_pending(hm_amx_pending *p, int n, int64_t ldo, int add, int silu) {
  if (!p->acc) return;
  const int end = p->done + n < 32 ? p->done + n : 32;
  for (int r = p->done; r < end; r++) {
    const int hi = r >= 16, rr = r & 15;
    hm_amx_emit(p->acc[2 * hi] + rr * 16, p->acc[2 * hi + 1] + rr * 16, 1, p->out + r * ldo, ldo,
                add, 1, silu);
  }
  p->done = end;
  if (end == 32) p->acc = NULL;
}

/* out = x times the panels' W^T (+ out where `add`); with `silu`, the panels are gate's then
 * up's (np even) and out [M, N/2] = silu(gate) * up: panel p goes with panel p + np/2, and their
 * products meet in the epilogue instead of a [M, N] output that a second pass reads back. */
static void hm_linear_bf16_amx(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels,
                               int np, int k, uint16_t *out, int64_t ldo, int add, int silu,
                               int threads) {
  const int kh = k / 2, pairs = silu ? np / 2 : (np + 1) / 2;
  const int64_t panel_elems = (int64_t)kh * 2 * HM_NR;
  /* a pair's second panel: the next one, or with `silu` the up panel half the panels on */
  const int64_t second = silu ? (int64_t)(np / 2) * panel_elems : panel_elems;
  const int step = silu ? 1 : 2; /* panels from one pair's first to the next's */
#pragma omp parallel num_threads(threads)
  {
    float acc[4][16 * 16] __attribute__((aligned(64)));
    /* two 32-row strips' accumulators: the tiles fill one while the other's epilogue runs, a few
     * rows each tile step (HM_AMX_BLOCK_ROWS says why) */
    float strip[2][4][16 * 16] __attribute__((aligned(64)));
    hm_amx_pending pend = {NULL, 0, 0};
    int configured = 0, cur = 0;
    /* this thread's rows or panels (HM_AMX_SPLIT_ROWS says which) */
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int by_rows = nt > 1 && m >= HM_AMX_SPLIT_ROWS;
    int r_begin = 0, r_end = m, g_begin = 0, g_end = pairs;
    if (by_rows) {
      const int strips = (m + 31) / 32;
      r_begin = (int)((int64_t)strips * tid / nt) * 32;
      r_end = (int)((int64_t)strips * (tid + 1) / nt) * 32;
      r_end = r_end < m ? r_end : m;
    } else {
      g_begin = (int)((int64_t)pairs * tid / nt);
      g_end = (int)((int64_t)pairs * (tid + 1) / nt);
    }
    for (int m0 = r_begin; m0 < r_end; m0 += HM_AMX_BLOCK_ROWS) {
      const int m1 = m0 + HM_AMX_BLOCK_ROWS < r_end ? m0 + HM_AMX_BLOCK_ROWS : r_end;
      for (int g = g_begin; g < g_end; g++) {
        const int p0 = step * g, two = silu || p0 + 1 < np;
        const uint16_t *b0 = panels + p0 * panel_elems, *b1 = b0 + second;
        uint16_t *col = out + (int64_t)g * HM_NR * (silu ? 1 : 2);
        /* the next pair's lines of each step kk are prefetched with this pair's: 1 KB of each of
         * its two panels, in flight while these work */
        const uint16_t *next0 = b0 + step * panel_elems, *next1 = next0 + second;
        int prefetch = g + 1 < g_end;
#define HM_AMX_PREFETCH(kk)                                                           \
  if (prefetch)                                                                       \
    for (int line = 0; line < 16 * 64; line += 64) {                                  \
      _mm_prefetch((const char *)(next0 + (int64_t)(kk) * HM_NR) + line, _MM_HINT_T0); \
      _mm_prefetch((const char *)(next1 + (int64_t)(kk) * HM_NR) + line, _MM_HINT_T0); \
    }
        int r0 = m0;
        if (two && m1 - m0 >= 32) { /* 32 rows at a time: each tile loaded feeds two products */
          if (configured != 32) {
            hm_amx_config_2x2();
            configured = 32;
          }
          const int per = (32 * HM_AMX_K + k - 1) / k; /* pending rows emitted per tile step */
          for (; r0 + 32 <= m1; r0 += 32, prefetch = 0) {
            const uint16_t *xr = x + (int64_t)r0 * ldx, *xr2 = xr + 16 * ldx;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int kk = 0; kk < k; kk += HM_AMX_K) {
              HM_AMX_PREFETCH(kk)
              _tile_loadd(4, xr + kk, ldx * 2);
              _tile_loadd(6, b0 + (int64_t)kk * HM_NR, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_loadd(7, b1 + (int64_t)kk * HM_NR, 64);
              _tile_dpbf16ps(1, 4, 7);
              _tile_loadd(5, xr2 + kk, ldx * 2);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
              hm_amx_emit_pending(&pend, per, ldo, add, silu);
            }
            hm_amx_emit_pending(&pend, 32, ldo, add, silu);
            _tile_stored(0, strip[cur][0], 64);
            _tile_stored(1, strip[cur][1], 64);
            _tile_stored(2, strip[cur][2], 64);
            _tile_stored(3, strip[cur][3], 64);
            pend.acc = strip[cur];
            pend.out = col + (int64_t)r0 * ldo;
            pend.done = 0;
            cur ^= 1;
          }
        }
        for (; r0 < m1; r0 += 16, prefetch = 0) {
          const int rows = m1 - r0 < 16 ? m1 - r0 : 16;
          if (configured != rows) {
            hm_amx_config(rows);
            configured = rows;
          }
          const uint16_t *xr = x + (int64_t)r0 * ldx;
          _tile_zero(0);
          _tile_zero(1);
          for (int kk = 0; kk < k; kk += HM_AMX_K) {
            HM_AMX_PREFETCH(kk)
            _tile_loadd(2, xr + kk, ldx * 2);
            _tile_loadd(3, b0 + (int64_t)kk * HM_NR, 64);
            _tile_dpbf16ps(0, 2, 3);
            if (two) {
              _tile_loadd(4, b1 + (int64_t)kk * HM_NR, 64);
              _tile_dpbf16ps(1, 2, 4);
            }
          }
          _tile_stored(0, acc[0], 64);
          if (two) _tile_stored(1, acc[1], 64);
          hm_amx_emit(acc[0], acc[1], rows, col + (int64_t)r0 * ldo, ldo, add, two, silu);
        }
#undef HM_AMX_PREFETCH
      }
    }
    hm_amx_emit_pending(&pend, 32, ldo, add, silu); /* the last strip's rows */
    if (configured) _tile_release();
  }
}
#endif

/* Rows of x worked on at once (a multiple of HM_MR): HM_X_BLOCK_BYTES of them. */
static int hm_x_block_rows(int k) {
  const int mb = (int)(HM_X_BLOCK_BYTES / ((int64_t)k * 2)) / HM_MR * HM_MR;
  return mb < HM_MR ? HM_MR : mb;
}

/* The `vdpbf16ps` pass of both entry points below (hm_linear_bf16_amx's twin): out = x times the
 * panels' W^T (+ out where `add`), or with `silu` SwiGLU's step of gate's panels (the first np/2)
 * and up's: gate's panel p and up's panel p + np/2 go to the same thread, 16 rows at a time, both
 * micro-kernels' bf16 outputs into a 16 x 32 tile on its stack (what the unfused matmul writes to
 * memory), then silu(gate) * up from the tile into out [M, N/2]. So the [M, N] gate/up output is
 * never written and read back, and a decode batch's SwiGLU, which hm_silu_mul_bf16 runs on one
 * thread below HM_PARALLEL_ROWS rows, runs on every thread. */
static void hm_linear_bf16_dp(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels,
                              int np, int k, uint16_t *out, int64_t ldo, int add, int silu,
                              int threads) {
  const int kh = k / 2, mb = hm_x_block_rows(k), items = silu ? np / 2 : np;
  const int64_t panel_elems = (int64_t)kh * 2 * HM_NR;
  int32_t *const xp = hm_x_scratch(m, kh); /* NULL: x as it lies */
  /* rows read as they lie (those outside xp's whole groups): through a padded copy when more
   * than 8 of them go to one micro-kernel call at a stride that aliases (see hm_x_aliases) */
  const int64_t ldp = ldx + 32;
  const size_t pad_bytes = 2 * (size_t)mb * ldp * sizeof(uint16_t); /* two blocks' rows */
  uint16_t *const pad = hm_x_aliases(ldx) && (xp ? m % 16 : m) > 8
                            ? (uint16_t *)hm_scratch(&hm_xpad, &hm_xpad_bytes, pad_bytes)
                            : NULL;
  /* one parallel region for every block of x: a thread goes on to its panels of the next block
   * without waiting for the other's (the same panels: a static schedule splits each block's
   * loop alike), so a thread that fell behind in one block does not stall both. With `pad`,
   * each block's copy ends in a barrier: both threads are then done with the block before the
   * last, whose half of the scratch the next copy takes. */
#pragma omp parallel num_threads(threads)
  {
    if (xp) hm_pack_x(x, ldx, m, kh, xp);
    for (int m0 = 0, b = 0; m0 < m; m0 += mb, b++) {
      const int rows = m - m0 < mb ? m - m0 : mb;
      const uint16_t *xb = x + (int64_t)m0 * ldx;
      int64_t ldb = ldx;
      if (pad) {
        uint16_t *copy = pad + (size_t)(b & 1) * mb * ldp;
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) memcpy(copy + r * ldp, xb + r * ldx, (size_t)k * 2);
        xb = copy;
        ldb = ldp;
      }
      uint16_t *ob = out + (int64_t)m0 * ldo;
#pragma omp for schedule(static) nowait
      for (int p = 0; p < items; p++) {
        const uint16_t *panel = panels + p * panel_elems;
        uint16_t tile[HM_MR * 2 * HM_NR] __attribute__((aligned(64)));
        for (int r = 0, ahead = 1; r < rows; r += HM_MR, ahead = 0) { /* the first prefetches */
          const int mr = rows - r < HM_MR ? rows - r : HM_MR;
          const uint16_t *xr = xb + r * ldb;
          uint16_t *o = ob + (int64_t)r * ldo + (int64_t)p * HM_NR;
          if (!silu) {
            hm_micro_rows(xp, m0 + r, mr, xr, ldb, panel, kh, o, ldo, ahead, add);
            continue;
          }
          const uint16_t *up = panel + items * panel_elems;
          hm_micro_rows(xp, m0 + r, mr, xr, ldb, panel, kh, tile, 2 * HM_NR, ahead, 0);
          hm_micro_rows(xp, m0 + r, mr, xr, ldb, up, kh, tile + HM_NR, 2 * HM_NR, ahead, 0);
          for (int i = 0; i < mr; i++) {
            const uint16_t *t = tile + i * 2 * HM_NR;
            hm_store_bf16(o + (int64_t)i * ldo,
                          hm_silu_mul16(hm_bf16_to_ps(t), hm_bf16_to_ps(t + HM_NR)));
          }
        }
      }
    }
  }
}

/* out [M, N] bf16 (row stride ldo) = x [M, K] bf16 (row stride ldx) times the panels' W^T, or
 * out += that when `add` (a residual connection in the same pass). The panels must be 64-byte
 * aligned. AMX tiles where the CPU has them and K is a multiple of 32 (from `amx_min_rows` rows
 * up), else `vdpbf16ps`. Returns 0 (1: built without AVX-512 BF16, nothing written). */
int hm_linear_bf16(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels, int n, int k,
                   uint16_t *out, int64_t ldo, int add, int threads, int amx_min_rows) {
  const int np = n / HM_NR;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (m >= amx_min_rows && k % HM_AMX_K == 0 && hm_amx_request()) {
    hm_linear_bf16_amx(x, ldx, m, panels, np, k, out, ldo, add, 0, threads);
    return 0;
  }
#else
  (void)amx_min_rows;
#endif
  hm_linear_bf16_dp(x, ldx, m, panels, np, k, out, ldo, add, 0, threads);
  return 0;
}

/* 1 when hm_linear_bf16 can use AMX tiles here (built with them, and the kernel grants them). */
int hm_linear_bf16_amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return hm_amx_request();
#else
  return 0;
#endif
}


/* ---- the element-wise steps around the matmuls, for bf16 rows (linear.c has the fp32 ones) ----
 * Each value is rounded to bf16 where the reference implementation (HF, over torch's bf16 ops)
 * rounds it, so that the results are the same bits up to the order of a sum. */

/* out[r] = w * bf16(x[r] / sqrt(mean(x[r]^2) + eps)), the sum of squares in fp32. */
void hm_rms_norm_bf16(const uint16_t *x, int64_t ldx, int rows, int dim, const uint16_t *w,
                      float eps, uint16_t *out, int64_t ldo, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= HM_PARALLEL_ROWS) schedule(static)
  for (int r = 0; r < rows; r++) {
    const uint16_t *xr = x + r * ldx;
    uint16_t *o = out + r * ldo;
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
      const __m512 v = hm_bf16_to_ps(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (int j = i; j < dim; j++) ss += hm_bf16_scalar(xr[j]) * hm_bf16_scalar(xr[j]);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (i = 0; i + 16 <= dim; i += 16) {
      const __m512 n = hm_round_ps(_mm512_mul_ps(hm_bf16_to_ps(xr + i), vinv));
      hm_store_bf16(o + i, _mm512_mul_ps(n, hm_bf16_to_ps(w + i)));
    }
    for (; i < dim; i++) {
      const float n = hm_bf16_scalar(hm_round_bf16(hm_bf16_scalar(xr[i]) * inv));
      o[i] = hm_round_bf16(n * hm_bf16_scalar(w[i]));
    }
  }
}

/* out [M, N/2] bf16 (row stride ldo) = SwiGLU's silu(gate) * up of x [M, K] times the panels'
 * W^T, gate's panels first, then up's: the values hm_linear_bf16 then hm_silu_mul_bf16 give, in
 * one pass: on AMX tiles (from amx_min_rows rows up, K a multiple of 32), else on `vdpbf16ps`.
 * Returns 0, or 2 where N/16 is odd (nothing written): the caller runs those two. */
int hm_linear_silu_bf16(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels, int n,
                        int k, uint16_t *out, int64_t ldo, int threads, int amx_min_rows) {
  const int np = n / HM_NR;
  if (np % 2) return 2;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (m >= amx_min_rows && k % HM_AMX_K == 0 && hm_amx_request()) {
    hm_linear_bf16_amx(x, ldx, m, panels, np, k, out, ldo, 0, 1, threads);
    return 0;
  }
#else
  (void)amx_min_rows;
#endif
  hm_linear_bf16_dp(x, ldx, m, panels, np, k, out, ldo, 0, 1, threads);
  return 0;
}

/* out[r][i] = bf16(bf16(silu(g)) * u) for g = gu[r][i], u = gu[r][inter + i]. */
void hm_silu_mul_bf16(const uint16_t *gu, int64_t ldg, int rows, int inter, uint16_t *out,
                      int64_t ldo, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= HM_PARALLEL_ROWS) schedule(static)
  for (int r = 0; r < rows; r++) {
    const uint16_t *g = gu + r * ldg, *u = g + inter;
    uint16_t *o = out + r * ldo;
    int i = 0;
    for (; i + 16 <= inter; i += 16)
      hm_store_bf16(o + i, hm_silu_mul16(hm_bf16_to_ps(g + i), hm_bf16_to_ps(u + i)));
    for (; i < inter; i++) {
      const float gf = hm_bf16_scalar(g[i]);
      const float sf = hm_bf16_scalar(hm_round_bf16(gf / (1.0f + expf(-gf))));
      o[i] = hm_round_bf16(sf * hm_bf16_scalar(u[i]));
    }
  }
}

int hm_linear_bf16_available(void) { return 1; }
#else
int hm_linear_bf16(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels, int n, int k,
                   uint16_t *out, int64_t ldo, int add, int threads, int amx_min_rows) {
  (void)x, (void)ldx, (void)m, (void)panels, (void)n, (void)k, (void)out, (void)ldo, (void)add;
  (void)threads, (void)amx_min_rows;
  return 1;
}

int hm_linear_bf16_amx_available(void) { return 0; }

void hm_rms_norm_bf16(const uint16_t *x, int64_t ldx, int rows, int dim, const uint16_t *w,
                      float eps, uint16_t *out, int64_t ldo, int threads) {
  (void)x, (void)ldx, (void)rows, (void)dim, (void)w, (void)eps, (void)out, (void)ldo;
  (void)threads;
}

int hm_linear_silu_bf16(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels, int n,
                        int k, uint16_t *out, int64_t ldo, int threads, int amx_min_rows) {
  (void)x, (void)ldx, (void)m, (void)panels, (void)n, (void)k, (void)out, (void)ldo;
  (void)threads, (void)amx_min_rows;
  return 2;
}

void hm_silu_mul_bf16(const uint16_t *gu, int64_t ldg, int rows, int inter, uint16_t *out,
                      int64_t ldo, int threads) {
  (void)gu, (void)ldg, (void)rows, (void)inter, (void)out, (void)ldo, (void)threads;
}

/* 1 when hm_linear_bf16 was built with its AVX-512 BF16 path. */
int hm_linear_bf16_available(void) { return 0; }
#endif
