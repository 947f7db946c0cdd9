/* Causal prefill attention on the CPU in bf16 (AVX-512 BF16): flash attention's online softmax
 * with both matmuls on `vdpbf16ps`, over keys read where they lie in the KV pool; and in fp32 on
 * AVX2 + FMA (below).
 *
 * Why: torch's CPU flash attention widens bf16 to fp32 and runs fp32 GEMMs, so on a CPU whose
 * fast dtype is bf16 a 1,024-token prefill of SmolLM2 spent 36% of its time in attention at
 * ~80 GFLOP/s, against ~400 for the layer's bf16 projections. Here Q.K^T and P.V take bf16
 * operands and sum in fp32 (P rounded to bf16 before P.V, as GPU flash attention does).
 *
 * Layout: key position p of a sequence lies at k + table[p / block_size] * block_stride +
 * (p % block_size) * tok_stride + head * head_stride (the pool's blocks; a fresh, contiguous K
 * is one block as long as the sequence), V the same. Query i sits at position start + i and
 * sees keys 0..start + i. The call first packs each KV head's keys and values for the dot
 * products (an O(S D) pass against the O(S^2 D) attention):
 *  - keys in chunks of 16, each a [D/2][16] array of 32-bit pairs (k[j][2p], k[j][2p + 1]), so
 *    one `vdpbf16ps` of a broadcast query pair against a line adds one pair's products to 16
 *    keys' scores;
 *  - values by pairs of keys, each a [D] array of (v[2j][d], v[2j + 1][d]), so one against a
 *    broadcast pair of probabilities adds two keys' weighted values to 16 output channels.
 * Keys past the sequence pack as zeros (their scores are masked, their weight is 0).
 *
 * Work items are (KV head, tile of HM_TILE query tokens), the tiles nearest the end (the most
 * keys) first; a tile's rows are its tokens x the G query heads sharing the KV head, walked in
 * panels of HM_PR rows against each block of HM_KB keys, so a key block is read from cache by
 * every panel while the tile's output accumulators (fp32) stay in a per-thread buffer.
 *
 * One driver (hm_prefill_run, at the end) packs, walks the tiles and panels and writes the rows
 * for both dtypes; each dtype supplies its packing, its panel and its row store (hm_prefill_isa).
 * The driver calls them through pointers once per chunk, panel and row, against thousands of
 * multiply-adds inside each, so the indirection costs nothing measurable.
 */

#define _GNU_SOURCE /* hm_amx.h: syscall() */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HM_PREFILL_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HM_PREFILL_F32 1
#endif

#include "hm_kernels.h"
#include "hm_amx.h"
#include "hm_exp.h"
#include "hm_tree16.h"

/* Where a sequence's keys and values lie: key position p of KV head h at
 * k + elem * (table[p / block_size] * block_stride + (p % block_size) * tok_stride +
 * h * head_stride), V the same. */
typedef struct {
  const char *k, *v;
  int64_t block_stride, tok_stride, head_stride; /* elements */
  const int64_t *table;
  int64_t block_size;
  int elem; /* bytes per element */
} hm_kv_view;

static inline const void *hm_kv_row(const hm_kv_view *kv, const char *base, int64_t p, int h) {
  return base + kv->elem * (kv->table[p / kv->block_size] * kv->block_stride +
                            (p % kv->block_size) * kv->tok_stride + (int64_t)h * kv->head_stride);
}

/* One dtype's part of the kernel. A chunk of `chunk` keys packs into chunk * D elements of keys
 * and as many of values, laid out as its panel reads them; a key block is `nc` chunks. */
typedef struct {
  int elem, chunk, nc, rows; /* bytes per element, keys per chunk, chunks per block, panel rows */
  int d_multiple;            /* head_dim must be a multiple of it */
  /* keys and values [c * chunk, c * chunk + chunk) of head h; zeros past s */
  void (*pack)(const hm_kv_view *kv, int h, int c, int64_t s, int d, void *kt, void *vp);
  /* n <= rows query rows against key block kb: the online softmax update of m, l and the rows'
   * fp32 accumulators o [n][d]. Row r lies at qrow[r]; the driver gathers a work item's rows
   * d elements apart, with at least `rows` rows readable from qrow[0]. */
  void (*panel)(int n, const void *const *qrow, const int64_t *pos, int kb, int masked,
                const void *kt, const void *vp, int d, float scale, float *m, float *l, float *o);
  void (*store)(const float *o, float inv, void *dst, int d); /* dst[:d] = o[:d] * inv */
  void (*thread_begin)(void), (*thread_end)(void); /* around a thread's panels, or NULL */
} hm_prefill_isa;

#define HM_PR_MAX 16 /* the most panel rows any dtype uses (the driver's row arrays) */

#if defined(HM_PREFILL_BF16) || defined(HM_PREFILL_F32)
static int hm_prefill_run(const hm_prefill_isa *isa, const void *q, int64_t q_tok,
                          int64_t q_head, const void *k, const void *v, int64_t block_stride,
                          int64_t tok_stride, int64_t head_stride, const int64_t *table,
                          int64_t block_size, int t, int start, int q_heads, int kv_heads, int d,
                          float scale, void *out, int64_t out_stride, int threads);
#endif

#define HM_TILE 32 /* query tokens per work item */
/* chunks of 16 keys per key block, even (the softmax converts them by pairs). On a CPU with two
 * 512-bit FMA pipes (Zen 5) 4 chunks and 6-row panels took 0.72-0.75 of the time of 2 and 4
 * (1,024 tokens of SmolLM2: 2.8 against 3.8 ms a layer): more independent accumulators keep
 * both pipes fed; on one with 256-bit halves (Zen 4) the two measured alike. */
#define HM_NC 4
#define HM_KB (16 * HM_NC) /* keys per block of the inner loop */
/* rows per panel: 24 score and 12 output accumulators (8 rows measured slower on Zen 5: the
 * scores no longer fit the registers; hm_panel_n has a case for each count up to it) */
#define HM_PR 6

int hm_prefill_attention_bf16_available(void) {
#ifdef HM_PREFILL_BF16
  return 1;
#else
  return 0;
#endif
}

#ifdef HM_PREFILL_BF16

/* Keys [c*16, c*16 + 16) of head h as kt[D/2][16] pairs; values pairs [c*8, c*8 + 8) as
 * vp[8][D] pairs. */
static void hm_pack_chunk(const hm_kv_view *kv, int h, int c, int64_t s, int d, void *ktv,
                          void *vpv) {
  uint32_t *kt = ktv, *vp = vpv;
  const int dh = d / 2;
  for (int j = 0; j < 16; j++) {
    const int64_t p = (int64_t)c * 16 + j;
    if (p < s) {
      const uint32_t *row = (const uint32_t *)hm_kv_row(kv, kv->k, p, h);
      for (int q = 0; q < dh; q++) kt[q * 16 + j] = row[q];
    } else {
      for (int q = 0; q < dh; q++) kt[q * 16 + j] = 0;
    }
  }
  /* interleave two value rows' bf16 lanes: (a0, b0, a1, b1, ...) */
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int jp = 0; jp < 8; jp++) {
    const int64_t p = (int64_t)c * 16 + 2 * jp;
    uint32_t *dst = vp + (int64_t)jp * d;
    const uint16_t *a = p < s ? hm_kv_row(kv, kv->v, p, h) : NULL;
    const uint16_t *b = p + 1 < s ? hm_kv_row(kv, kv->v, p + 1, h) : NULL;
    for (int d0 = 0; d0 < d; d0 += 32) {
      const __m512i va = a ? _mm512_loadu_si512(a + d0) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d0, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(dst + d0 + 16, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

static inline __m512bh hm_bcast_pair(const uint16_t *x) {
  int32_t pair;
  memcpy(&pair, x, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

/* 2^y of 16 lanes (y <= 0, or -inf: 0) to bf16's precision, for the probabilities, which are
 * rounded to bf16 before P.V: a degree-3 polynomial on [-0.5, 0.5] (relative error below 8e-5,
 * against bf16's rounding step of 2^-8) and no clamp (scalef takes 2^n to 0 far below 0). The
 * bf16 panels score in powers of two: scale times log2(e) in one multiply, m in those units.
 * Only a masked block has -inf lanes (`masked`, a constant where it is inlined): the others
 * skip the compare that takes them to 0. */
static inline __attribute__((always_inline)) __m512 hm_exp2_bf16(__m512 y, const int masked) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05518098f), f, _mm512_set1_ps(0.24263459f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69326131f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999262f));
  const __m512 r = _mm512_scalef_ps(p, n);
  if (!masked) return r;
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ), r);
}

#define HM_LOG2E 1.44269504088896341f
#define HM_LN2 0.69314718055994531f

/* One row's online-softmax step over key block kb (shared by both bf16 panels): its HM_NC
 * vectors of raw scores sc, masked past the row's position `pos` when `masked`, move the row's
 * running max *m and mass *l; its probabilities go to pb as bf16 (HM_KB of them). Returns alpha,
 * the factor the row's accumulators take for the new max. */
static inline __attribute__((always_inline)) float hm_softmax_row(const __m512 *sc, int masked,
                                                                  int kb, int64_t pos,
                                                                  float scale, float *m,
                                                                  float *l, uint16_t *pb) {
  const __m512 vscale = _mm512_set1_ps(scale * HM_LOG2E), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 x[HM_NC];
  __m512 mxv = ninf;
  for (int c = 0; c < HM_NC; c++) {
    x[c] = _mm512_mul_ps(sc[c], vscale);
    if (masked) { /* keys past the row's position */
      const __m512i key = _mm512_add_epi32(iota, _mm512_set1_epi32(kb * HM_KB + 16 * c));
      const __mmask16 late = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32((int32_t)pos));
      x[c] = _mm512_mask_blend_ps(late, x[c], ninf);
    }
    mxv = _mm512_max_ps(mxv, x[c]);
  }
  const float mx = _mm512_reduce_max_ps(mxv);
  const float mnew = mx > *m ? mx : *m;
  /* key 0 is in every row's first block, so mnew is finite from the first block on; 0 on the
   * first block (m = -inf), and exactly 1 (hm_exp(0)) where the max stayed, as most blocks past
   * the first few find: that scalar e^x is skipped there */
  const float alpha = mnew == *m ? 1.0f : hm_exp((*m - mnew) * HM_LN2);
  *m = mnew;
  const __m512 vm = _mm512_set1_ps(mnew);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < HM_NC; c += 2) {
    __m512 p0, p1;
    if (masked) {
      p0 = hm_exp2_bf16(_mm512_sub_ps(x[c], vm), 1);
      p1 = hm_exp2_bf16(_mm512_sub_ps(x[c + 1], vm), 1);
    } else {
      p0 = hm_exp2_bf16(_mm512_sub_ps(x[c], vm), 0);
      p1 = hm_exp2_bf16(_mm512_sub_ps(x[c + 1], vm), 0);
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    const __m512bh packed = _mm512_cvtne2ps_pbh(p1, p0);
    memcpy(pb + 16 * c, &packed, sizeof packed);
  }
  *l = *l * alpha + _mm512_reduce_add_ps(sum);
  return alpha;
}

/* R rows (R <= HM_PR, a constant where it is inlined) against one key block kb: scores, online
 * softmax update of m, l and the rows' accumulators o (fp32 [R][D], row stride d). */
static inline __attribute__((always_inline)) void hm_panel(
    const int R, const uint16_t *const *qrow, const int64_t *pos, int kb, int masked,
    const uint32_t *kt, const uint32_t *vp, int d, float scale, float *m, float *l, float *o) {
  const int dh = d / 2;
  __m512 s[HM_PR][HM_NC];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < HM_NC; c++) s[r][c] = _mm512_setzero_ps();
  const uint32_t *k0 = kt + (int64_t)(HM_NC * kb) * dh * 16;
  for (int p = 0; p < dh; p++) {
    __m512bh kv[HM_NC];
    for (int c = 0; c < HM_NC; c++)
      kv[c] = (__m512bh)_mm512_load_si512(k0 + ((int64_t)c * dh + p) * 16);
    for (int r = 0; r < R; r++) {
      const __m512bh qp = hm_bcast_pair(qrow[r] + 2 * p);
      for (int c = 0; c < HM_NC; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], qp, kv[c]);
    }
  }
  uint16_t pb[HM_PR][HM_KB] __attribute__((aligned(64)));
  float alpha[HM_PR];
  for (int r = 0; r < R; r++)
    alpha[r] = hm_softmax_row(s[r], masked, kb, pos[r], scale, m + r, l + r, pb[r]);
  const uint32_t *v0 = vp + (int64_t)kb * (HM_KB / 2) * d;
  for (int c = 0; c < d; c += 32) {
    __m512 acc[HM_PR][2];
    for (int r = 0; r < R; r++) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
      acc[r][0] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), al);
      acc[r][1] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c + 16), al);
    }
    for (int jp = 0; jp < HM_KB / 2; jp++) {
      const __m512bh a = (__m512bh)_mm512_load_si512(v0 + (int64_t)jp * d + c);
      const __m512bh b = (__m512bh)_mm512_load_si512(v0 + (int64_t)jp * d + c + 16);
      for (int r = 0; r < R; r++) {
        const __m512bh pp = hm_bcast_pair(pb[r] + 2 * jp);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pp, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pp, b);
      }
    }
    for (int r = 0; r < R; r++) {
      _mm512_storeu_ps(o + r * d + c, acc[r][0]);
      _mm512_storeu_ps(o + r * d + c + 16, acc[r][1]);
    }
  }
}

static void hm_panel_n(int n, const void *const *qrowv, const int64_t *pos, int kb, int masked,
                       const void *kt, const void *vp, int d, float scale, float *m, float *l,
                       float *o) {
  const uint16_t *const *qrow = (const uint16_t *const *)qrowv;
  switch (n) { /* each a copy with its row count a constant, so its accumulators are registers */
#define HM_PANEL_CASE(R) \
  case R: hm_panel(R, qrow, pos, kb, masked, kt, vp, d, scale, m, l, o); break;
    HM_PANEL_CASE(6) HM_PANEL_CASE(5) HM_PANEL_CASE(4) HM_PANEL_CASE(3) HM_PANEL_CASE(2)
    default: hm_panel(1, qrow, pos, kb, masked, kt, vp, d, scale, m, l, o); break;
#undef HM_PANEL_CASE
  }
}

static void hm_store_row(const float *o, float inv, void *dstv, int d) {
  uint16_t *dst = dstv;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int c = 0; c < d; c += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c), vinv));
    memcpy(dst + c, &b, sizeof b);
  }
}

_Static_assert(HM_PR <= HM_PR_MAX, "the driver's row arrays hold HM_PR_MAX rows");
static const hm_prefill_isa hm_prefill_bf16_isa = {
    2, 16, HM_NC, HM_PR, 32, hm_pack_chunk, hm_panel_n, hm_store_row, NULL, NULL};

#ifdef HM_AMX
/* With AMX tiles: the same packing, the same online softmax, both matmuls on `tdpbf16ps`.
 * Why: on a 2-core Xeon with AMX, the `vdpbf16ps` path above took 8.2 ms a layer over 1,024
 * tokens of SmolLM2 and torch's SDPA 3.6, while the layer's projections (AMX) took 5.1.
 *
 * A key chunk's packed keys, [D/2][16] pairs, are the B operand of a tile step as they lie (16
 * lines of 64 bytes: 32 channels' pairs for 16 keys), and 16 query rows' 32 channels, read in
 * place, the A operand; so are 16 pairs of keys' packed values [16 pairs][16 channels] (row
 * stride D) against 16 rows' probabilities for those 32 keys. A panel is 16 rows: its 16 x 64
 * scores go through 4 accumulator tiles to memory for the softmax (AVX-512), its probabilities
 * come back as bf16 A tiles, and each block's P.V lands in fresh accumulators that are added
 * into o, scaled by the rows' alpha, in AVX-512 (a tile cannot be scaled in place).
 * Tiles: 0-3 accumulate, 4 holds the A operand (queries, then probabilities), 5 and 6 B. */
#define HM_AMX_ROWS 16

static void hm_amx_begin(void) {
  hm_tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 7; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  hm_tile_loadconfig(&cfg);
}

static void hm_amx_end(void) { _tile_release(); }

/* P.V of the block's 64 keys for channels [c0, c0 + 16 * NT) into tmp [16][64] fp32 (NT 4 or 2,
 * a constant where it is inlined). */
static inline __attribute__((always_inline)) void hm_amx_pv(const int NT, const uint16_t *pb,
                                                            const uint32_t *v0, int d, int c0,
                                                            float *tmp) {
  _tile_zero(0);
  _tile_zero(1);
  if (NT == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int sb = 0; sb < HM_KB / 32; sb++) { /* 32 keys: 16 pairs of rows of the packed values */
    _tile_loadd(4, pb + 32 * sb, HM_KB * 2);
    const uint32_t *v = v0 + (int64_t)16 * sb * d + c0;
    _tile_loadd(5, v, d * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, v + 16, d * 4);
    _tile_dpbf16ps(1, 4, 6);
    if (NT == 4) {
      _tile_loadd(5, v + 32, d * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, v + 48, d * 4);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, tmp, 64 * 4);
  _tile_stored(1, tmp + 16, 64 * 4);
  if (NT == 4) {
    _tile_stored(2, tmp + 32, 64 * 4);
    _tile_stored(3, tmp + 48, 64 * 4);
  }
}

/* The online-softmax step of a panel's n rows from their scores s [16][64] (scaled in place),
 * all 16 rows' maxima and masses at once: each row's four vectors reduced to one, then the
 * sixteen rows' vectors to one vector of 16 rows (HM_TREE16_OP), where hm_softmax_row, a row at
 * a time, took two horizontal reductions, a scalar compare and a scalar e^x each. Probabilities
 * to pb [16][64] bf16 (rows past n zero), each row's alpha to alpha[]. A row's arithmetic is the
 * same wherever it sits in the panel. On the 2-core AMX Xeon, a 1,024-token layer of SmolLM2
 * took 1.65-1.70 -> 1.31-1.35 ms (medians of 60, three alternating runs); the mass l is summed
 * in another order than hm_softmax_row's, so the output moves by a rounding step here and there.
 */
static inline __attribute__((always_inline)) void hm_amx_softmax(
    float *s, int n, int masked, int kb, const int64_t *pos, float scale, float *m, float *l,
    uint16_t *pb, float *alpha) {
  const __m512 vscale = _mm512_set1_ps(scale * HM_LOG2E), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 live = (__mmask16)((1u << n) - 1u);
  __m512 red[16];
  for (int r = 0; r < 16; r++) {
    if (r >= n) {
      red[HM_TREE16[r]] = ninf;
      continue;
    }
    __m512 mx = ninf;
    for (int c = 0; c < HM_NC; c++) {
      __m512 x = _mm512_mul_ps(_mm512_load_ps(s + r * HM_KB + 16 * c), vscale);
      if (masked) { /* keys past the row's position */
        const __m512i key = _mm512_add_epi32(iota, _mm512_set1_epi32(kb * HM_KB + 16 * c));
        const __mmask16 late = _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32((int32_t)pos[r]));
        x = _mm512_mask_blend_ps(late, x, ninf);
      }
      _mm512_store_ps(s + r * HM_KB + 16 * c, x);
      mx = _mm512_max_ps(mx, x);
    }
    red[HM_TREE16[r]] = mx;
  }
  __m512 mx;
  HM_TREE16_OP(red, _mm512_max_ps, mx);
  const __m512 mold = _mm512_mask_loadu_ps(ninf, live, m);
  const __m512 mnew = _mm512_max_ps(mx, mold);
  /* 0 on the first block (m = -inf), exactly 1 where the max stayed (hm_exp16 as hm_exp) */
  const __mmask16 moved = _mm512_cmp_ps_mask(mnew, mold, _CMP_NEQ_UQ);
  const __m512 al = _mm512_mask_blend_ps(
      moved, _mm512_set1_ps(1.0f),
      hm_exp16(_mm512_mul_ps(_mm512_sub_ps(mold, mnew), _mm512_set1_ps(HM_LN2))));
  _mm512_mask_storeu_ps(m, live, mnew);
  _mm512_storeu_ps(alpha, al);
  float mrow[16] __attribute__((aligned(64)));
  _mm512_store_ps(mrow, mnew);
  for (int r = 0; r < 16; r++) {
    if (r >= n) {
      red[HM_TREE16[r]] = _mm512_setzero_ps();
      memset(pb + r * HM_KB, 0, HM_KB * 2); /* zero weights, whatever the row's query held */
      continue;
    }
    const __m512 vm = _mm512_set1_ps(mrow[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < HM_NC; c += 2) {
      const __m512 x0 = _mm512_sub_ps(_mm512_load_ps(s + r * HM_KB + 16 * c), vm);
      const __m512 x1 = _mm512_sub_ps(_mm512_load_ps(s + r * HM_KB + 16 * c + 16), vm);
      __m512 p0, p1;
      if (masked) {
        p0 = hm_exp2_bf16(x0, 1);
        p1 = hm_exp2_bf16(x1, 1);
      } else {
        p0 = hm_exp2_bf16(x0, 0);
        p1 = hm_exp2_bf16(x1, 0);
      }
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      const __m512bh packed = _mm512_cvtne2ps_pbh(p1, p0);
      memcpy(pb + r * HM_KB + 16 * c, &packed, sizeof packed);
    }
    red[HM_TREE16[r]] = sum;
  }
  __m512 sums;
  HM_TREE16_OP(red, _mm512_add_ps, sums);
  const __m512 lold = _mm512_mask_loadu_ps(_mm512_setzero_ps(), live, l);
  _mm512_mask_storeu_ps(l, live, _mm512_add_ps(_mm512_mul_ps(lold, al), sums));
}

static void hm_panel_amx(int n, const void *const *qrow, const int64_t *pos, int kb, int masked,
                         const void *ktv, const void *vpv, int d, float scale, float *m, float *l,
                         float *o) {
  const uint16_t *q = qrow[0]; /* 16 rows, d apart */
  const uint32_t *k0 = (const uint32_t *)ktv + (int64_t)(HM_NC * kb) * (d / 2) * 16;
  float s[HM_AMX_ROWS][HM_KB] __attribute__((aligned(64)));
  uint16_t pb[HM_AMX_ROWS][HM_KB] __attribute__((aligned(64)));
  float alpha[HM_AMX_ROWS] __attribute__((aligned(64)));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int d0 = 0; d0 < d; d0 += 32) { /* chunk c's lines d0/2.. hold channels d0..d0+31 */
    _tile_loadd(4, q + d0, d * 2);
    const uint32_t *k = k0 + (int64_t)(d0 / 2) * 16;
    _tile_loadd(5, k, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, k + (int64_t)(d / 2) * 16, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, k + (int64_t)d * 16, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, k + (int64_t)(3 * d / 2) * 16, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, s[0], HM_KB * 4);
  _tile_stored(1, s[0] + 16, HM_KB * 4);
  _tile_stored(2, s[0] + 32, HM_KB * 4);
  _tile_stored(3, s[0] + 48, HM_KB * 4);
  hm_amx_softmax(s[0], n, masked, kb, pos, scale, m, l, pb[0], alpha);
  const uint32_t *v0 = (const uint32_t *)vpv + (int64_t)kb * (HM_KB / 2) * d;
  float tmp[HM_AMX_ROWS][64] __attribute__((aligned(64)));
  for (int c0 = 0; c0 < d; c0 += 64) {
    const int wide = d - c0 >= 64, width = wide ? 64 : 32;
    if (wide)
      hm_amx_pv(4, pb[0], v0, d, c0, tmp[0]);
    else
      hm_amx_pv(2, pb[0], v0, d, c0, tmp[0]);
    for (int r = 0; r < n; r++) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < width; c += 16) {
        float *dst = o + (int64_t)r * d + c0 + c;
        const __m512 add = _mm512_load_ps(tmp[r] + c);
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), al, add));
      }
    }
  }
}

static const hm_prefill_isa hm_prefill_amx_isa = {
    2, 16, HM_NC, HM_AMX_ROWS, 32, hm_pack_chunk, hm_panel_amx, hm_store_row, hm_amx_begin,
    hm_amx_end};
_Static_assert(HM_AMX_ROWS <= HM_PR_MAX, "the driver's row arrays hold HM_PR_MAX rows");
_Static_assert(HM_KB == 64, "hm_panel_amx scores a block of keys in 4 tiles of 16");
#endif

#endif

/* out[i, qh*D + :] (bf16, row stride out_stride) = causal attention of query rows q (bf16,
 * token stride q_tok, head stride q_head) at positions start..start+t-1 over keys 0..start+t-1.
 * head_dim a multiple of 32 (<= 256), q_heads a multiple of kv_heads; on AMX tiles where `amx`
 * and the CPU has them. 0 on success, -1 when memory ran out, -2 when this library was built
 * without AVX-512 BF16, -3 on bad arguments. */
int hm_prefill_attention_bf16(const uint16_t *q, int64_t q_tok, int64_t q_head, const uint16_t *k,
                              const uint16_t *v, int64_t block_stride, int64_t tok_stride,
                              int64_t head_stride, const int64_t *table, int64_t block_size,
                              int t, int start, int q_heads, int kv_heads, int d, float scale,
                              uint16_t *out, int64_t out_stride, int threads, int amx) {
#ifndef HM_PREFILL_BF16
  (void)q; (void)q_tok; (void)q_head; (void)k; (void)v; (void)block_stride; (void)tok_stride;
  (void)head_stride; (void)table; (void)block_size; (void)t; (void)start; (void)q_heads;
  (void)kv_heads; (void)d; (void)scale; (void)out; (void)out_stride; (void)threads; (void)amx;
  return -2;
#else
  const hm_prefill_isa *isa = &hm_prefill_bf16_isa;
#ifdef HM_AMX
  if (amx && hm_amx_request()) isa = &hm_prefill_amx_isa;
#else
  (void)amx;
#endif
  return hm_prefill_run(isa, q, q_tok, q_head, k, v, block_stride, tok_stride, head_stride, table,
                        block_size, t, start, q_heads, kv_heads, d, scale, out, out_stride,
                        threads);
#endif
}

/* ---- the same in fp32 on AVX2 + FMA ----
 *
 * Why: torch's CPU flash attention took 20 ms a layer (58 GFLOP/s, 28% of a 1,024-token fp32
 * prefill of SmolLM2) on a 2-vCPU AVX2 EPYC whose linear layers ran at ~108 GFLOP/s.
 *
 * The bf16 path's plan at 8 lanes: keys packed per KV head in chunks of 8, each a [D][8] array
 * (one broadcast query element against a line adds its products to 8 keys' scores), values
 * copied as rows [key][D] beside them (one broadcast probability against a row adds a key's
 * weighted value to 8 output channels). A key block is HM_FNC chunks; a panel of HM_FPR rows
 * keeps its HM_FPR x HM_FNC score accumulators in registers (of 16), then HM_FPR x 2 output ones
 * per 16 channels. */

/* chunks of 8 keys per key block, and rows per panel (hm_panel_f_n has a case for each count up
 * to it). On the AVX2 EPYC, 1,024 tokens of SmolLM2 (ms a layer, 2 threads): 4 x 3 15.8, 3 x 3
 * 16.1, 6 x 2 16.7, 2 x 6 17.1, 3 x 4 17.9, 4 x 4 17.5, 8 x 2 18.8; torch's SDPA 20.4. Larger
 * key blocks spread each row's softmax step over more keys. */
#define HM_FNC 4
#define HM_FKB (8 * HM_FNC) /* keys per block of the inner loop */
#define HM_FPR 3            /* rows per panel */

int hm_prefill_attention_f32_available(void) {
#ifdef HM_PREFILL_F32
  return 1;
#else
  return 0;
#endif
}

#ifdef HM_PREFILL_F32

/* Keys [c*8, c*8 + 8) of head h as kt[D][8], their values as rows vr[8][D]; zeros past s. */
static void hm_pack_chunk_f(const hm_kv_view *kv, int h, int c, int64_t s, int d, void *ktv,
                            void *vrv) {
  float *kt = ktv, *vr = vrv;
  for (int j = 0; j < 8; j++) {
    const int64_t p = (int64_t)c * 8 + j;
    float *row = vr + (int64_t)j * d;
    if (p < s) {
      const float *key = hm_kv_row(kv, kv->k, p, h);
      for (int q = 0; q < d; q++) kt[q * 8 + j] = key[q];
      memcpy(row, hm_kv_row(kv, kv->v, p, h), (size_t)d * 4);
    } else {
      for (int q = 0; q < d; q++) kt[q * 8 + j] = 0.0f;
      memset(row, 0, (size_t)d * 4);
    }
  }
}

static inline float hm_hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hm_hsum8(__m256 x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

/* R rows (R <= HM_FPR, a constant where it is inlined) against key block kb: scores, the online
 * softmax update of m, l and the rows' accumulators o (fp32 [R][D], row stride d). */
static inline __attribute__((always_inline)) void hm_panel_f(
    const int R, const float *const *qrow, const int64_t *pos, int kb, int masked,
    const float *kt, const float *vr, int d, float scale, float *m, float *l, float *o) {
  __m256 s[HM_FPR][HM_FNC];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < HM_FNC; c++) s[r][c] = _mm256_setzero_ps();
  const float *k0 = kt + (int64_t)(HM_FNC * kb) * d * 8;
  for (int p = 0; p < d; p++) {
    __m256 kv[HM_FNC];
    for (int c = 0; c < HM_FNC; c++) kv[c] = _mm256_load_ps(k0 + ((int64_t)c * d + p) * 8);
    for (int r = 0; r < R; r++) {
      const __m256 qb = _mm256_broadcast_ss(qrow[r] + p);
      for (int c = 0; c < HM_FNC; c++) s[r][c] = _mm256_fmadd_ps(qb, kv[c], s[r][c]);
    }
  }
  float pb[HM_FPR][HM_FKB] __attribute__((aligned(32)));
  float alpha[HM_FPR];
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < R; r++) {
    __m256 x[HM_FNC];
    __m256 mxv = ninf;
    for (int c = 0; c < HM_FNC; c++) {
      x[c] = _mm256_mul_ps(s[r][c], vscale);
      if (masked) { /* keys past the row's position */
        const __m256i key = _mm256_add_epi32(iota, _mm256_set1_epi32(kb * HM_FKB + 8 * c));
        const __m256i late = _mm256_cmpgt_epi32(key, _mm256_set1_epi32((int32_t)pos[r]));
        x[c] = _mm256_blendv_ps(x[c], ninf, _mm256_castsi256_ps(late));
      }
      mxv = _mm256_max_ps(mxv, x[c]);
    }
    const float mx = hm_hmax8(mxv);
    const float mnew = mx > m[r] ? mx : m[r];
    /* key 0 is in every row's first block, so mnew is finite from the first block on; 0 on the
     * first block (m = -inf), exactly 1 where the max stayed (hm_softmax_row's shortcut) */
    alpha[r] = mnew == m[r] ? 1.0f : hm_exp(m[r] - mnew);
    m[r] = mnew;
    const __m256 vm = _mm256_set1_ps(mnew);
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < HM_FNC; c++) {
      const __m256 p = hm_exp8(_mm256_sub_ps(x[c], vm)); /* 0 where masked */
      sum = _mm256_add_ps(sum, p);
      _mm256_store_ps(pb[r] + 8 * c, p);
    }
    l[r] = l[r] * alpha[r] + hm_hsum8(sum);
  }
  const float *v0 = vr + (int64_t)kb * HM_FKB * d;
  for (int c = 0; c < d; c += 16) {
    __m256 acc[HM_FPR][2];
    for (int r = 0; r < R; r++) {
      const __m256 al = _mm256_set1_ps(alpha[r]);
      acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c), al);
      acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c + 8), al);
    }
    for (int j = 0; j < HM_FKB; j++) {
      const __m256 a = _mm256_load_ps(v0 + (int64_t)j * d + c);
      const __m256 b = _mm256_load_ps(v0 + (int64_t)j * d + c + 8);
      for (int r = 0; r < R; r++) {
        const __m256 pp = _mm256_broadcast_ss(pb[r] + j);
        acc[r][0] = _mm256_fmadd_ps(pp, a, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pp, b, acc[r][1]);
      }
    }
    for (int r = 0; r < R; r++) {
      _mm256_storeu_ps(o + r * d + c, acc[r][0]);
      _mm256_storeu_ps(o + r * d + c + 8, acc[r][1]);
    }
  }
}

static void hm_panel_f_n(int n, const void *const *qrowv, const int64_t *pos, int kb, int masked,
                         const void *ktv, const void *vrv, int d, float scale, float *m, float *l,
                         float *o) {
  const float *const *qrow = (const float *const *)qrowv;
  const float *kt = ktv, *vr = vrv;
  switch (n) { /* each a copy with its row count a constant, so its accumulators are registers */
#define HM_PANEL_F_CASE(R) \
  case R: hm_panel_f(R, qrow, pos, kb, masked, kt, vr, d, scale, m, l, o); break;
    HM_PANEL_F_CASE(3) HM_PANEL_F_CASE(2)
    default: hm_panel_f(1, qrow, pos, kb, masked, kt, vr, d, scale, m, l, o); break;
#undef HM_PANEL_F_CASE
  }
}

static void hm_store_row_f(const float *o, float inv, void *dstv, int d) {
  float *dst = dstv;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int c = 0; c < d; c += 8)
    _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), vinv));
}

_Static_assert(HM_FPR <= HM_PR_MAX, "the driver's row arrays hold HM_PR_MAX rows");
static const hm_prefill_isa hm_prefill_f32_isa = {
    4, 8, HM_FNC, HM_FPR, 16, hm_pack_chunk_f, hm_panel_f_n, hm_store_row_f, NULL, NULL};

#endif

/* hm_prefill_attention_bf16's contract in fp32 (q, k, v and out float), head_dim a multiple of
 * 16 (<= 256); -2 when this library was built without AVX2 + FMA. */
int hm_prefill_attention_f32(const float *q, int64_t q_tok, int64_t q_head, const float *k,
                             const float *v, int64_t block_stride, int64_t tok_stride,
                             int64_t head_stride, const int64_t *table, int64_t block_size, int t,
                             int start, int q_heads, int kv_heads, int d, float scale, float *out,
                             int64_t out_stride, int threads) {
#ifndef HM_PREFILL_F32
  (void)q; (void)q_tok; (void)q_head; (void)k; (void)v; (void)block_stride; (void)tok_stride;
  (void)head_stride; (void)table; (void)block_size; (void)t; (void)start; (void)q_heads;
  (void)kv_heads; (void)d; (void)scale; (void)out; (void)out_stride; (void)threads;
  return -2;
#else
  return hm_prefill_run(&hm_prefill_f32_isa, q, q_tok, q_head, k, v, block_stride, tok_stride,
                        head_stride, table, block_size, t, start, q_heads, kv_heads, d, scale,
                        out, out_stride, threads);
#endif
}

/* ---- the driver, shared by both dtypes ---- */

#if defined(HM_PREFILL_BF16) || defined(HM_PREFILL_F32)
static int hm_prefill_run(const hm_prefill_isa *isa, const void *q, int64_t q_tok,
                          int64_t q_head, const void *k, const void *v, int64_t block_stride,
                          int64_t tok_stride, int64_t head_stride, const int64_t *table,
                          int64_t block_size, int t, int start, int q_heads, int kv_heads, int d,
                          float scale, void *out, int64_t out_stride, int threads) {
  if (t <= 0 || start < 0 || d % isa->d_multiple || d > 256 || kv_heads <= 0 ||
      q_heads % kv_heads || block_size <= 0)
    return -3;
  const int g = q_heads / kv_heads, kb_keys = isa->chunk * isa->nc;
  const int64_t s = (int64_t)start + t;
  const int64_t chunks = isa->nc * ((s + kb_keys - 1) / kb_keys);
  const int64_t chunk_bytes = (int64_t)isa->chunk * d * isa->elem; /* of keys; as many of values */
  const int64_t head_bytes = chunks * chunk_bytes;
  char *kt = aligned_alloc(64, (size_t)head_bytes * 2 * kv_heads);
  if (!kt) return -1;
  char *vp = kt + head_bytes * kv_heads;
  const hm_kv_view kv = {k, v, block_stride, tok_stride, head_stride, table, block_size,
                         isa->elem};
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < chunks * kv_heads; i++) {
    const int h = (int)(i / chunks), c = (int)(i % chunks);
    isa->pack(&kv, h, c, s, d, kt + h * head_bytes + c * chunk_bytes,
              vp + h * head_bytes + c * chunk_bytes);
  }
  const char *qb = q;
  char *ob = out;
  const int tiles = (t + HM_TILE - 1) / HM_TILE, rows_max = HM_TILE * g, pr = isa->rows;
  /* a work item's query rows, gathered d elements apart, and room for a last panel's full rows */
  const int64_t row_bytes = (int64_t)d * isa->elem;
  const size_t q_bytes = (size_t)((rows_max + pr) * row_bytes + 63) / 64 * 64;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float *o = aligned_alloc(64, (size_t)rows_max * (d + 2) * 4 + q_bytes);
    float *m = o ? o + (int64_t)rows_max * d : NULL, *l = m ? m + rows_max : NULL;
    char *qt = o ? (char *)(l + rows_max) : NULL;
    if (!o) {
#pragma omp atomic write
      failed = 1;
    } else {
      memset(qt, 0, q_bytes);
      if (isa->thread_begin) isa->thread_begin();
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < (int64_t)tiles * kv_heads; item++) {
      if (!o) continue;
      const int tile = tiles - 1 - (int)(item / kv_heads), h = (int)(item % kv_heads);
      const int i0 = tile * HM_TILE, i1 = i0 + HM_TILE < t ? i0 + HM_TILE : t;
      const int rows = (i1 - i0) * g;
      for (int r = 0; r < rows; r++) { /* row r: token i0 + r/g, head h*g + r%g */
        const int i = i0 + r / g, qh = h * g + r % g;
        memcpy(qt + r * row_bytes, qb + isa->elem * ((int64_t)i * q_tok + (int64_t)qh * q_head),
               (size_t)row_bytes);
        m[r] = -INFINITY, l[r] = 0.0f;
      }
      memset(o, 0, (size_t)rows * d * 4);
      const char *hkt = kt + h * head_bytes, *hvp = vp + h * head_bytes;
      const int64_t first = (int64_t)start + i0, last = (int64_t)start + i1 - 1;
      const int blocks = (int)(last / kb_keys) + 1;
      for (int kb = 0; kb < blocks; kb++) {
        const int masked = (int64_t)kb * kb_keys + kb_keys - 1 > first;
        for (int r0 = 0; r0 < rows; r0 += pr) {
          const int n = rows - r0 < pr ? rows - r0 : pr;
          const void *qrow[HM_PR_MAX];
          int64_t pos[HM_PR_MAX];
          for (int r = 0; r < n; r++) {
            qrow[r] = qt + (r0 + r) * row_bytes;
            pos[r] = (int64_t)start + i0 + (r0 + r) / g;
          }
          isa->panel(n, qrow, pos, kb, masked, hkt, hvp, d, scale, m + r0, l + r0,
                     o + (int64_t)r0 * d);
        }
      }
      for (int r = 0; r < rows; r++) {
        const int i = i0 + r / g, qh = h * g + r % g;
        isa->store(o + (int64_t)r * d, 1.0f / l[r],
                   ob + isa->elem * ((int64_t)i * out_stride + (int64_t)qh * d), d);
      }
    }
    if (o && isa->thread_end) isa->thread_end();
    free(o);
  }
  free(kt);
  return failed ? -1 : 0;
}
#endif
