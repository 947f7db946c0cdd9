/* Paged decode attention on the CPU, fused: full-precision blocks (fp32, bf16, fp16) and KIVI
 * blocks (2/4/8-bit codes, float16 scales and zero points), read where they lie in the pool.
 *
 * Why C: the torch path gathers each split's blocks into a staging buffer, widens it to fp32
 * (KIVI: unpacks codes, multiplies by scales, adds zeros, each a full pass over memory) and only
 * then attends, so a 4-bit block costs more time than the fp32 block it replaces. Here every
 * byte of KV is read once, widened in registers, and used at once: a packed block costs less
 * than a full one, as KIVI's own CUDA kernels make it.
 *
 * One work item is one (sequence, KV head): its G = q_heads / kv_heads query rows walk the
 * sequence's blocks with an online softmax (running max m, mass l, accumulator acc), block by
 * block. KIVI keys are per-channel affine (k = code * s + z, s and z per channel for a group of
 * tokens), so q . k = (q * s) . code + q . z: q is rescaled once per key group instead of
 * dequantizing every key. Outputs: out [B, QH, D] fp32 and lse [B, QH] fp32, the log-sum-exp of
 * the scaled scores (-inf and out 0 for a sequence of length 0), as the torch twin returns them.
 *
 * Built by kernels/native_build.py with the system C compiler (-O3 -march=native -fopenmp)
 * and loaded with ctypes; every pointer, stride and bound is checked in Python before the call, and block
 * ids are checked here (a bad table returns an error instead of reading outside the pool).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hm_kernels.h"
#include "hm_exp.h"
#include "hm_tree16.h"

#define HM_MAX_BS 256
#define HM_MAX_GROUP 16 /* query rows a KIVI block scores with one bias array */
/* the next block's key rows prefetched in one burst as a block-head starts (hm_block64 says where
 * that pays): on cores with AMX only */
#ifdef __AMX_TILE__
#define HM_KEYS_AHEAD 1
#else
#define HM_KEYS_AHEAD 0
#endif

enum { HM_F32 = 0, HM_BF16 = 1, HM_F16 = 2 };

static inline float hm_half(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  float f;
  if (exp == 0) {
    f = ldexpf((float)man, -24);
    return sign ? -f : f;
  }
  bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13));
  memcpy(&f, &bits, 4);
  return f;
#endif
}

static inline void hm_halves(const uint16_t *src, int n, float *dst) {
  int i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
  for (; i < n; i++) dst[i] = hm_half(src[i]);
}

/* A row of n elements as fp32: the row itself (fp32) or widened into buf. */
static inline const float *hm_row(const void *src, int dtype, int n, float *buf) {
  if (dtype == HM_F32) return (const float *)src;
  const uint16_t *s = (const uint16_t *)src;
  if (dtype == HM_BF16) {
    int i0 = 0;
#ifdef __AVX512F__
    for (; i0 + 16 <= n; i0 += 16) { /* bf16 is fp32's top half: widen by a shift */
      const __m256i h = _mm256_loadu_si256((const __m256i *)(s + i0));
      _mm512_storeu_ps(buf + i0, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
#elif defined(__AVX2__)
    for (; i0 + 8 <= n; i0 += 8) {
      const __m128i h = _mm_loadu_si128((const __m128i *)(s + i0));
      _mm256_storeu_ps(buf + i0, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
    for (int i = i0; i < n; i++) {
      uint32_t bits = (uint32_t)s[i] << 16;
      memcpy(buf + i, &bits, 4);
    }
  } else {
    hm_halves(s, n, buf);
  }
  return buf;
}

static inline float hm_dot(const float *a, const float *b, int n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; i++) acc += a[i] * b[i];
  return acc;
}

/* codes of one row (n values, 8/bits a byte, low bits first) as floats */
static inline void hm_unpack(const uint8_t *codes, int bits, int n, float *dst) {
  int i = 0; /* codes done */
#ifdef __AVX2__
  if (bits == 4) {
    const __m128i low = _mm_set1_epi8(15);
#ifdef __AVX512F__
    for (; i + 32 <= n; i += 32) { /* as below, sixteen codes a vector: half the conversions */
      __m128i b = _mm_loadu_si128((const __m128i *)(codes + i / 2));
      __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))));
      _mm512_storeu_ps(dst + i + 16,
                       _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))));
    }
#endif
    for (; i + 32 <= n; i += 32) { /* 16 bytes -> 32 codes (none left here on AVX-512) */
      __m128i b = _mm_loadu_si128((const __m128i *)(codes + i / 2));
      __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);
      _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c0)));
      _mm256_storeu_ps(dst + i + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c0, 8))));
      _mm256_storeu_ps(dst + i + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c1)));
      _mm256_storeu_ps(dst + i + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c1, 8))));
    }
  } else if (bits == 2) {
    const __m128i three = _mm_set1_epi8(3);
    for (; i + 32 <= n; i += 32) { /* 8 bytes -> 32 codes */
      __m128i b = _mm_loadl_epi64((const __m128i *)(codes + i / 4));
      __m128i x0 = _mm_and_si128(b, three), x1 = _mm_and_si128(_mm_srli_epi16(b, 2), three);
      __m128i x2 = _mm_and_si128(_mm_srli_epi16(b, 4), three);
      __m128i x3 = _mm_and_si128(_mm_srli_epi16(b, 6), three);
      /* byte j -> codes 4j..4j+3 = x0[j], x1[j], x2[j], x3[j] */
      __m128i p01 = _mm_unpacklo_epi8(x0, x1), p23 = _mm_unpacklo_epi8(x2, x3);
      __m128i c0 = _mm_unpacklo_epi16(p01, p23), c1 = _mm_unpackhi_epi16(p01, p23);
      _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c0)));
      _mm256_storeu_ps(dst + i + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c0, 8))));
      _mm256_storeu_ps(dst + i + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c1)));
      _mm256_storeu_ps(dst + i + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c1, 8))));
    }
  }
#endif
  if (bits == 4) {
    for (; i < n; i += 2) {
      dst[i] = (float)(codes[i / 2] & 15);
      dst[i + 1] = (float)(codes[i / 2] >> 4);
    }
  } else if (bits == 2) {
    for (; i < n; i += 4) {
      uint8_t c = codes[i / 4];
      dst[i] = (float)(c & 3);
      dst[i + 1] = (float)((c >> 2) & 3);
      dst[i + 2] = (float)((c >> 4) & 3);
      dst[i + 3] = (float)(c >> 6);
    }
  } else {
    for (; i < n; i++) dst[i] = (float)codes[i];
  }
}

/* row[i] = row[i] * scale[i / group] + zero[i / group], group by group (vectorisable). */
static inline void hm_affine(float *row, const float *scale, const float *zero, int n,
                             int group) {
  for (int g0 = 0, gi = 0; g0 < n; g0 += group, gi++) {
    const float s = scale[gi], z = zero[gi];
    const int end = g0 + group < n ? g0 + group : n;
#pragma omp simd
    for (int i = g0; i < end; i++) row[i] = row[i] * s + z;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Eight vectors' lane sums as one vector, lane j the sum of a[j]: a reduction tree (hadd, lane
 * swap) instead of eight horizontal sums. */
static inline __m256 hm_tree8(const __m256 *a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  /* lane 0 of h0123 holds the low halves' sums of rows 0-3, lane 1 the high halves' */
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
#endif

/* Scores of query row q against the n key rows k[0..n) (d values each, fp32), plus `bias`. With
 * AVX2, eight rows at a time: eight vector sums, then one reduction tree (hadd, lane swap) that
 * turns them into the eight scores at once, instead of one horizontal sum per score; otherwise
 * four rows at a time, so q is loaded once per four dot products. */
static void hm_scores(const float *q, const float *const *k, int n, int d, float bias,
                      float *s) {
  int t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    for (; t + 8 <= n; t += 8) {
      __m256 a[8];
      for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
      for (int i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[t + j] + i), a[j]);
      }
      const __m256 sum = hm_tree8(a);
      _mm256_storeu_ps(s + t, _mm256_add_ps(sum, _mm256_set1_ps(bias)));
    }
  }
#endif
  for (; t + 4 <= n; t += 4) {
    const float *k0 = k[t], *k1 = k[t + 1], *k2 = k[t + 2], *k3 = k[t + 3];
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int i = 0; i < d; i++) {
      a0 += q[i] * k0[i];
      a1 += q[i] * k1[i];
      a2 += q[i] * k2[i];
      a3 += q[i] * k3[i];
    }
    s[t] = a0 + bias;
    s[t + 1] = a1 + bias;
    s[t + 2] = a2 + bias;
    s[t + 3] = a3 + bias;
  }
  for (; t < n; t++) s[t] = hm_dot(q, k[t], d) + bias;
}

/* acc[0..d) += sum_t p[t] * v[t][0..d), four rows at a time (acc is loaded and stored once per
 * four rows). */
static void hm_accumulate(float *acc, const float *p, const float *const *v, int n, int d) {
  int t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *v0 = v[t], *v1 = v[t + 1], *v2 = v[t + 2], *v3 = v[t + 3];
    const float p0 = p[t], p1 = p[t + 1], p2 = p[t + 2], p3 = p[t + 3];
#pragma omp simd
    for (int i = 0; i < d; i++) acc[i] += p0 * v0[i] + p1 * v1[i] + p2 * v2[i] + p3 * v3[i];
  }
  for (; t < n; t++) {
    const float pt = p[t], *vt = v[t];
#pragma omp simd
    for (int i = 0; i < d; i++) acc[i] += pt * vt[i];
  }
}

/* Ask for `bytes` from p on into the cache ahead of use: the next block's KV is fetched from
 * memory while this block is computed on (a decode step reads KV that is in no cache, and the
 * hardware prefetcher does not follow a block table from one block to the next). Into L2, not
 * L1 (prefetcht1): a block-head is 64 lines, more misses than L1 tracks at once, so prefetcht0
 * stalled on them; into L2 the step took half the time (bench/kernels.py's 8 x 4096 tokens on a
 * 2-core AVX-512 CPU: bf16 160 -> 85 ms, fp32 160 -> 100 ms). */
static inline void hm_prefetch(const void *p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
}

/* Whether block j of a table has a next block within the sequence's len tokens that lies in the
 * pool (its rows are then prefetched while block j is worked on) */
static inline int hm_next_block(const int32_t *table, int j, int len, int block_size,
                                int64_t num_blocks) {
  return (j + 1) * block_size < len && table[j + 1] >= 0 && table[j + 1] < num_blocks;
}

/* Online-softmax state of one sequence's query rows (all heads), and its scratch. */
typedef struct {
  int rows, d;
  int dv;        /* value columns accumulated and written: d, but MLA's latent rows' first dv */
  float *q;      /* [rows][d] query rows, pre-scaled */
  float *acc;    /* [rows][d] unnormalised output (its first dv columns in use) */
  float *m, *l;  /* [rows] running max and mass */
  float *s;      /* [rows][HM_MAX_BS]: one block's scores, then its probabilities */
  float *kbuf, *vbuf; /* [HM_MAX_BS][d]: one block-head's rows widened to fp32 */
  float *qs;     /* [group][d]: query rows times a key group's scales (KIVI) */
  float *scratch;     /* [2][d] (KIVI scales and zeros) */
  uint16_t *qb;  /* [rows][d]: the query rows in bf16, when q_bf16 or qb_scale */
  int q_bf16;    /* 1: every pre-scaled query value is a bf16 exactly (q from a bf16 model) */
  float qb_scale; /* rows wider than 64: nonzero when qb holds the query rows unscaled, each a
                   * bf16 exactly, for the tiles' dot products (the scale then on their sums) */
} hm_state;

/* Each thread's scratch, kept from call to call: a decode step calls the kernel once per layer,
 * and a fresh ~150 KB per work item (past malloc's mmap threshold) cost page faults every time. */
static _Thread_local float *hm_scratch;
static _Thread_local size_t hm_scratch_floats;

static int hm_begin(hm_state *st, const float *q, int rows, int group, int d, float scale) {
  const size_t n = (size_t)rows * d * 2 + (size_t)rows * (2 + HM_MAX_BS) +
                   (size_t)HM_MAX_BS * d * 2 + (size_t)group * d + 2 * (size_t)d +
                   ((size_t)rows * d + 1) / 2;
  if (n > hm_scratch_floats) {
    float *grown = (float *)realloc(hm_scratch, n * sizeof(float));
    if (!grown) return 0;
    hm_scratch = grown;
    hm_scratch_floats = n;
  }
  float *mem = hm_scratch;
  st->rows = rows;
  st->d = d;
  st->dv = d;
  st->q = mem;
  st->acc = st->q + (size_t)rows * d;
  st->m = st->acc + (size_t)rows * d;
  st->l = st->m + rows;
  st->s = st->l + rows;
  st->kbuf = st->s + (size_t)rows * HM_MAX_BS;
  st->vbuf = st->kbuf + (size_t)HM_MAX_BS * d;
  st->qs = st->vbuf + (size_t)HM_MAX_BS * d;
  st->scratch = st->qs + (size_t)group * d;
  st->qb = (uint16_t *)(st->scratch + 2 * (size_t)d);
  /* qb: the pre-scaled rows at head_dim 64 (whose scale, 1/8, keeps a bf16 one), the unscaled
   * ones for the wider rows' tiles (their scale then goes on the dot products' sums) */
  const float *in_bf16 = d > 64 ? q : st->q;
  int exact = 1;
  for (int i = 0; i < rows * d; i++) {
    st->q[i] = q[i] * scale;
    uint32_t bits;
    memcpy(&bits, in_bf16 + i, 4);
    st->qb[i] = (uint16_t)(bits >> 16);
    exact &= (bits & 0xffffu) == 0; /* widening it back gives the same float */
  }
  st->q_bf16 = d > 64 ? 0 : exact;
  st->qb_scale = d > 64 && exact ? scale : 0.0f;
  memset(st->acc, 0, sizeof(float) * rows * d);
  for (int r = 0; r < rows; r++) {
    st->m[r] = -INFINITY;
    st->l[r] = 0.0f;
  }
  return 1;
}

/* Rows [r0, r0 + g): their scores st->s[r][0:n] become probabilities against an updated
 * running max; the accumulator and mass are rescaled when the max moves. */
static void hm_softmax_block(hm_state *st, int r0, int g, int n) {
  for (int r = r0; r < r0 + g; r++) {
    float *s = st->s + (size_t)r * HM_MAX_BS;
    float bm = -INFINITY;
    for (int t = 0; t < n; t++) bm = s[t] > bm ? s[t] : bm;
    float m_new = st->m[r] > bm ? st->m[r] : bm;
    if (st->m[r] != m_new) {
      float alpha = st->m[r] == -INFINITY ? 0.0f : expf(st->m[r] - m_new);
      float *acc = st->acc + (size_t)r * st->d;
      st->l[r] *= alpha;
      for (int i = 0; i < st->dv; i++) acc[i] *= alpha;
      st->m[r] = m_new;
    }
    float mass = 0.0f;
    int t0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (; t0 + 8 <= n; t0 += 8) {
        const __m256 pv = hm_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t0), mv));
        _mm256_storeu_ps(s + t0, pv);
        sum = _mm256_add_ps(sum, pv);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, sum);
      for (int i = 0; i < 8; i++) mass += lanes[i];
    }
#endif
    for (int t = t0; t < n; t++) {
      float p = hm_exp(s[t] - m_new);
      s[t] = p;
      mass += p;
    }
    st->l[r] += mass;
  }
}

/* out [rows][dv] (the accumulator's first dv columns over the mass) and lse [rows] */
static void hm_finish(hm_state *st, float *out, float *lse) {
  for (int r = 0; r < st->rows; r++) {
    float inv = st->l[r] > 0.0f ? 1.0f / st->l[r] : 0.0f;
    const float *acc = st->acc + (size_t)r * st->d;
    for (int i = 0; i < st->dv; i++) out[(size_t)r * st->dv + i] = acc[i] * inv;
    lse[r] = st->l[r] > 0.0f ? st->m[r] + logf(st->l[r]) : -INFINITY;
  }
}

/* Softmax and values of one block-head: rows [h*g, h*g + g) over n value rows v. */
static void hm_block_values(hm_state *st, int h, int g, int n, const float *const *v) {
  hm_softmax_block(st, h * g, g, n);
  for (int r = h * g; r < h * g + g; r++)
    hm_accumulate(st->acc + (size_t)r * st->d, st->s + (size_t)r * HM_MAX_BS, v, n, st->d);
}

/* A KIVI block-head's value rows as they lie, for the register block paths: each row's codes
 * (`bits` each, low bits first) and its f16 scales and zero points, one per group of gv channels
 * (gv a multiple of the path's vector width: 16 for hm_block64, 8 for hm_block8). */
typedef struct {
  const uint8_t *codes[16];
  const uint16_t *scale[16], *zero[16];
  int bits, gv;
  int group_stride; /* halves from one row's scales (and zeros) to the next row's */
} hm_kivi_values;

/* The next block's rows of the head a block path is on, to prefetch while it works on this
 * block's: row t's key and value lie t * stride bytes after k and v (each `bytes` long). */
typedef struct {
  const char *k, *v;
  int64_t stride, bytes;
} hm_next_rows;

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HM_BLOCK64 1
/* Sixteen vectors' lane sums as one vector (hm_tree16.h; lane j: vector HM_TREE16[j]'s sum). */
static inline __m512 hm_tree16(__m512 *a) {
  __m512 out;
  HM_TREE16_OP(a, _mm512_add_ps, out);
  return out;
}

/* Codes 16c .. 16c + 15 of a row as 16 floats: their 2 * bits bytes spread over the lanes (lane
 * l takes the 32-bit word holding bit l * bits), shifted down and masked. */
static inline __m512 hm_codes16(const uint8_t *codes, int c, int bits, __m512i idx, __m512i shift,
                                __m512i mask) {
  const __m128i raw = _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * bits)) - 1u), codes + 2 * c * bits);
  const __m512i w = _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(raw));
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shift), mask));
}

/* One block-head of head_dim 64 in registers: the G query rows [r0, r0 + G) against the n <= 16
 * key and value rows. Scores: each key row's four vectors against each query row, the
 * sixteen keys' sums at once (hm_tree16); softmax on one 16-lane vector a row; values: each
 * value row loaded once for all G rows, the G x 4 accumulator vectors held in registers. G is a
 * compile-time constant at each call (G x 4 accumulators, 16 at most), and so is `bf16`: rows
 * of fp32 (k, v: float rows; query rows qrows), or of bf16 read where they lie (query rows qb in
 * bf16: a key row's 32 pairs against the query's in two `vdpbf16ps`, its products exact in fp32
 * as the widened rows' are; value rows widened in registers). */
static inline __attribute__((always_inline)) void hm_block64(
    hm_state *st, int r0, const int G, int n, const void *const *k, const void *const *v,
    const float *qrows, const uint16_t *qb, const float *bias, const int bf16,
    const hm_kivi_values *kv, const hm_next_rows *next) {
  const __mmask16 live = (__mmask16)((1u << n) - 1u);
  float prob[4][16];
  /* HM_KEYS_AHEAD: the next block's key rows now, in flight while this block's scores are worked
   * out, and its value rows one per value row below. On the 2-core AMX Xeon, 8 x 4,096 tokens x
   * 30 layers in bf16 took 47.8-49.7 against 48.9-50.4 ms a step (four alternating runs); on the
   * 2-core AVX-512 BF16 EPYC (Zen 4, no AMX) the burst stalled the core, 28.9-30.5 against
   * 25.0-28.5 ms, so there both rows go one per value row. AMX stands in for the core here. */
#if HM_KEYS_AHEAD
  if (next)
    for (int t = 0; t < n; t++) hm_prefetch(next->k + t * next->stride, next->bytes);
#endif
  for (int r = 0; r < G; r++) {
    __m512 a[16];
#ifdef __AVX512BF16__
    if (bf16) {
      const uint16_t *q = qb + (size_t)r * 64;
      const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q), q1 = (__m512bh)_mm512_loadu_si512(q + 32);
      for (int t = 0; t < 16; t++) {
        if (t < n) {
          const uint16_t *kt = (const uint16_t *)k[t];
          const __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0,
                                            (__m512bh)_mm512_loadu_si512(kt));
          a[HM_TREE16[t]] = _mm512_dpbf16_ps(x, q1, (__m512bh)_mm512_loadu_si512(kt + 32));
        } else {
          a[HM_TREE16[t]] = _mm512_setzero_ps();
        }
      }
    } else
#endif
    {
      const float *q = qrows + (size_t)r * 64;
      const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
      const __m512 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
      for (int t = 0; t < 16; t++) {
        if (t < n) {
          const float *kt = (const float *)k[t];
          __m512 x = _mm512_mul_ps(q0, _mm512_loadu_ps(kt));
          x = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kt + 16), x);
          x = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kt + 32), x);
          a[HM_TREE16[t]] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kt + 48), x);
        } else {
          a[HM_TREE16[t]] = _mm512_setzero_ps();
        }
      }
    }
    __m512 sc = hm_tree16(a); /* lane t: key t's score */
    if (bias) sc = _mm512_add_ps(sc, _mm512_set1_ps(bias[r]));
    const float bm = _mm512_mask_reduce_max_ps(live, sc);
    const int row = r0 + r;
    const float m_new = st->m[row] > bm ? st->m[row] : bm;
    if (st->m[row] != m_new) {
      const float alpha = st->m[row] == -INFINITY ? 0.0f : expf(st->m[row] - m_new);
      float *acc = st->acc + (size_t)row * 64;
      st->l[row] *= alpha;
      for (int c = 0; c < 64; c += 16)
        _mm512_storeu_ps(acc + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), _mm512_set1_ps(alpha)));
      st->m[row] = m_new;
    }
    const __m512 pr = _mm512_maskz_mov_ps(live, hm_exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
    st->l[row] += _mm512_reduce_add_ps(pr);
    _mm512_storeu_ps(prob[r], pr);
  }
  __m512 acc[16];
  for (int r = 0; r < G; r++)
    for (int c = 0; c < 4; c++) acc[r * 4 + c] = _mm512_loadu_ps(st->acc + (size_t)(r0 + r) * 64 + c * 16);
  __m512i idx = _mm512_setzero_si512(), shift = idx, mask = idx;
  /* KIVI values (v = code * s + z, s and z per group of gv channels of a row): a block's
   * sum_t p_t v_t is sum_t (p_t s_t) code_t + sum_t p_t z_t, so each row's codes go into the
   * accumulators as they are, against probabilities scaled by the row's group scales (ps, one
   * 16-lane product a row and group), and the zero points come in once a block (zs). Rebuilding
   * every value row (an FMA a vector, a half-float scale and zero fetched and widened a vector)
   * had cost more than the row's products. */
  float ps[4][4][16] __attribute__((aligned(64))), zs[4][4];
  int vgrp[4] = {0, 0, 0, 0}; /* the group of each 16 channels */
  if (kv) { /* lane l of a 16-code group: bit l * bits, in 32-bit word (l * bits) / 32 */
    const __m512i bitpos = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(kv->bits));
    idx = _mm512_srli_epi32(bitpos, 5);
    shift = _mm512_and_si512(bitpos, _mm512_set1_epi32(31));
    mask = _mm512_set1_epi32((1 << kv->bits) - 1);
    for (int c = 0; c < 4; c++) vgrp[c] = c * 16 / kv->gv;
    const int vg = vgrp[3] + 1; /* groups a row: gv is 16, 32 or 64 here */
    /* each group's scales and zeros of the 16 rows as a vector (rows past n: probability 0,
     * scale and zero 0). Two groups at once where a row has an even number: a 32-bit gather of
     * the pair, split into halves. Fetched a half at a time in a scalar loop, they had cost
     * 0.05-0.1 of a 4-bit step (8 x 4,096 tokens x 30 layers, 45-48 against 42-43 ms without
     * them, on the 2-core AVX-512 BF16 EPYC). */
    __m512 sgv[4], zgv[4];
    if (vg % 2 == 0) {
      const __m512i rows_at = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(2 * kv->group_stride)); /* bytes from row 0's */
      for (int g = 0; g < vg; g += 2) {
        const __m512i s2 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows_at,
                                                        kv->scale[0] + g, 1);
        const __m512i z2 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows_at,
                                                        kv->zero[0] + g, 1);
        sgv[g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(s2));
        sgv[g + 1] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(s2, 16)));
        zgv[g] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(z2));
        zgv[g + 1] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(z2, 16)));
      }
    } else {
      uint16_t sh[16] __attribute__((aligned(32))), zh[16] __attribute__((aligned(32)));
      for (int t = 0; t < 16; t++) { /* one group a row */
        sh[t] = t < n ? kv->scale[t][0] : 0;
        zh[t] = t < n ? kv->zero[t][0] : 0;
      }
      sgv[0] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)sh));
      zgv[0] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)zh));
    }
    for (int g = 0; g < vg; g++) {
      const __m512 sg = sgv[g], zg = zgv[g];
      for (int r = 0; r < G; r++) {
        const __m512 pr = _mm512_loadu_ps(prob[r]);
        _mm512_store_ps(ps[r][g], _mm512_mul_ps(pr, sg));
        zs[r][g] = _mm512_reduce_add_ps(_mm512_mul_ps(pr, zg));
      }
    }
  }
  for (int t = 0; t < n; t++) {
    __m512 v0, v1, v2, v3;
    /* the next block's value rows (and, without HM_KEYS_AHEAD, its key rows), one per value row
     * here: all issued at once before the block they queued up behind the few misses a core
     * keeps in flight and stalled it; spread over the block, 8 x 4,096 tokens x 30 layers bf16
     * went 0.81-0.83 of the time on a 2-core AVX-512 BF16 EPYC */
    if (next) { /* the next block is as long as this one: only a last block is short */
#if !HM_KEYS_AHEAD
      hm_prefetch(next->k + t * next->stride, next->bytes);
#endif
      hm_prefetch(next->v + t * next->stride, next->bytes);
    }
    if (kv) { /* the codes, against the probabilities scaled by their group's scale */
      const uint8_t *ct = kv->codes[t];
      v0 = hm_codes16(ct, 0, kv->bits, idx, shift, mask);
      v1 = hm_codes16(ct, 1, kv->bits, idx, shift, mask);
      v2 = hm_codes16(ct, 2, kv->bits, idx, shift, mask);
      v3 = hm_codes16(ct, 3, kv->bits, idx, shift, mask);
      for (int r = 0; r < G; r++) {
        acc[r * 4] = _mm512_fmadd_ps(_mm512_set1_ps(ps[r][vgrp[0]][t]), v0, acc[r * 4]);
        acc[r * 4 + 1] = _mm512_fmadd_ps(_mm512_set1_ps(ps[r][vgrp[1]][t]), v1, acc[r * 4 + 1]);
        acc[r * 4 + 2] = _mm512_fmadd_ps(_mm512_set1_ps(ps[r][vgrp[2]][t]), v2, acc[r * 4 + 2]);
        acc[r * 4 + 3] = _mm512_fmadd_ps(_mm512_set1_ps(ps[r][vgrp[3]][t]), v3, acc[r * 4 + 3]);
      }
      continue;
    } else if (bf16) { /* bf16 is fp32's top half: widened by a shift */
      const uint16_t *vt = (const uint16_t *)v[t];
#define HM_WIDEN(o) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vt + (o)))), 16))
      v0 = HM_WIDEN(0), v1 = HM_WIDEN(16), v2 = HM_WIDEN(32), v3 = HM_WIDEN(48);
#undef HM_WIDEN
    } else {
      const float *vt = (const float *)v[t];
      v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16);
      v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
    }
    for (int r = 0; r < G; r++) {
      const __m512 pt = _mm512_set1_ps(prob[r][t]);
      acc[r * 4] = _mm512_fmadd_ps(pt, v0, acc[r * 4]);
      acc[r * 4 + 1] = _mm512_fmadd_ps(pt, v1, acc[r * 4 + 1]);
      acc[r * 4 + 2] = _mm512_fmadd_ps(pt, v2, acc[r * 4 + 2]);
      acc[r * 4 + 3] = _mm512_fmadd_ps(pt, v3, acc[r * 4 + 3]);
    }
  }
  if (kv) /* the block's zero points, sum_t p_t z_t of each row and group */
    for (int r = 0; r < G; r++)
      for (int c = 0; c < 4; c++)
        acc[r * 4 + c] = _mm512_add_ps(acc[r * 4 + c], _mm512_set1_ps(zs[r][vgrp[c]]));
  for (int r = 0; r < G; r++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(st->acc + (size_t)(r0 + r) * 64 + c * 16, acc[r * 4 + c]);
}

/* The g rows [r0, r0 + g) of one block-head with hm_block64 where it applies (head_dim 64, a
 * block of 16 rows at most): fp32 rows k, v (bf16 = 0) with their query rows from qrows on (64
 * floats apart) and a score bias each (NULL: none), or bf16 rows as they lie in the pool (bf16
 * = 1: the state's bf16 query rows, no bias); 0 where it does not apply (the caller runs the
 * general path). */
static inline int hm_block64_rows(hm_state *st, int r0, int g, int n, const void *const *k,
                                  const void *const *v, const float *qrows, const float *bias,
                                  int bf16, const hm_kivi_values *kv,
                                  const hm_next_rows *next) {
  if (st->d != 64 || n > 16) return 0;
#ifndef __AVX512BF16__
  if (bf16) return 0;
#endif
  if (bf16 && !st->q_bf16) return 0;
  const uint16_t *qb = bf16 ? st->qb + (size_t)r0 * 64 : NULL;
  /* four rows a call, then the rest: G a constant at each call */
#define HM_BLOCK64_CASES(B)                                                      \
  switch (m) {                                                                   \
    case 4: hm_block64(st, r0, 4, n, k, v, qrows, qb, bias, B, kv, next); break; \
    case 3: hm_block64(st, r0, 3, n, k, v, qrows, qb, bias, B, kv, next); break; \
    case 2: hm_block64(st, r0, 2, n, k, v, qrows, qb, bias, B, kv, next); break; \
    default: hm_block64(st, r0, 1, n, k, v, qrows, qb, bias, B, kv, next); break; \
  }
  while (g > 0) {
    const int m = g < 4 ? g : 4;
    if (bf16) {
      HM_BLOCK64_CASES(1)
    } else {
      HM_BLOCK64_CASES(0)
    }
    g -= m;
    r0 += m;
    next = NULL; /* prefetched by the first rows' call */
    qrows = qrows ? qrows + m * 64 : NULL;
    qb = qb ? qb + m * 64 : NULL;
    bias = bias ? bias + m : NULL;
  }
#undef HM_BLOCK64_CASES
  return 1;
}
#endif

#if !defined(HM_BLOCK64) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HM_BLOCK8 1
/* The AVX2 twin of hm_block64 (CPUs without AVX-512): one block-head of head_dim 64, n <= 16
 * rows, in eight-lane registers. A query row's 16 scores come from two groups of eight keys, each
 * summed at once by hm_scores' reduction tree; softmax runs on those two vectors; a row's output
 * (eight vectors) stays in registers while the block's value rows stream past. Rows are read
 * where they lie and widened in registers: fp32, bf16 (fp32's top half: a shift) or fp16 (F16C).
 * KIVI value rows come unpacked (one pass into scratch, not one per query row). 16 registers
 * hold one query
 * row's accumulators, not G of them, so key and value rows are read once per query row (from L1
 * after the first). */

/* Eight values of a row from column c on, as fp32 (dtype a constant at each call). */
static inline __attribute__((always_inline)) __m256 hm_load8(const void *row, int c, int dtype) {
  if (dtype == HM_F32) return _mm256_loadu_ps((const float *)row + c);
  const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + c));
  if (dtype == HM_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void hm_block8(
    hm_state *st, int r0, int g, int n, const void *const *k, const void *const *v,
    const float *qrows, const float *bias, const int dtype, const hm_next_rows *next) {
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256 dead = _mm256_set1_ps(-INFINITY);
  /* lanes of the two score vectors that hold a key of this block */
  const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
  const __m256 live1 = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane));
  for (int r = 0; r < g; r++) {
    const float *q = qrows + (size_t)r * 64;
    __m256 sc[2];
    for (int h = 0; h < 2; h++) {
      __m256 a[8];
      for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
      const int m = n - 8 * h < 8 ? n - 8 * h : 8; /* keys in this half (may be <= 0) */
      for (int c = 0; c < 64; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; j++)
          if (j < m) a[j] = _mm256_fmadd_ps(qv, hm_load8(k[8 * h + j], c, dtype), a[j]);
      }
      sc[h] = hm_tree8(a);
    }
    if (bias) {
      sc[0] = _mm256_add_ps(sc[0], _mm256_set1_ps(bias[r]));
      sc[1] = _mm256_add_ps(sc[1], _mm256_set1_ps(bias[r]));
    }
    sc[0] = _mm256_blendv_ps(dead, sc[0], live0);
    sc[1] = _mm256_blendv_ps(dead, sc[1], live1);
    __m256 mx = _mm256_max_ps(sc[0], sc[1]);
    mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 0x01));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1));
    const float bm = _mm256_cvtss_f32(mx);
    const int row = r0 + r;
    float *accp = st->acc + (size_t)row * 64;
    const float m_new = st->m[row] > bm ? st->m[row] : bm;
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(accp + 8 * c);
    if (st->m[row] != m_new) {
      const float alpha = st->m[row] == -INFINITY ? 0.0f : expf(st->m[row] - m_new);
      st->l[row] *= alpha;
      for (int c = 0; c < 8; c++) acc[c] = _mm256_mul_ps(acc[c], _mm256_set1_ps(alpha));
      st->m[row] = m_new;
    }
    const __m256 mv = _mm256_set1_ps(m_new);
    float prob[16]; /* exp(-inf - m) is 0: dead lanes add nothing */
    const __m256 p0 = hm_exp8(_mm256_sub_ps(sc[0], mv)), p1 = hm_exp8(_mm256_sub_ps(sc[1], mv));
    _mm256_storeu_ps(prob, _mm256_and_ps(p0, live0));
    _mm256_storeu_ps(prob + 8, _mm256_and_ps(p1, live1));
    float mass = 0.0f;
    for (int t = 0; t < n; t++) mass += prob[t];
    st->l[row] += mass;
    for (int t = 0; t < n; t++) {
      if (next && r == 0) { /* the next block's rows, spread as in hm_block64 */
        hm_prefetch(next->k + t * next->stride, next->bytes);
        hm_prefetch(next->v + t * next->stride, next->bytes);
      }
      const __m256 pt = _mm256_set1_ps(prob[t]);
      for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(pt, hm_load8(v[t], 8 * c, dtype), acc[c]);
    }
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(accp + 8 * c, acc[c]);
  }
}

/* The g rows [r0, r0 + g) of one block-head with hm_block8 where it applies (head_dim 64, a
 * block of 16 rows at most): rows of `dtype` as they lie, query rows from qrows on and a score
 * bias each (NULL: none); 0 where it does not apply. */
static inline int hm_block8_rows(hm_state *st, int r0, int g, int n, const void *const *k,
                                 const void *const *v, const float *qrows, const float *bias,
                                 int dtype, const hm_next_rows *next) {
  if (st->d != 64 || n > 16) return 0;
  if (dtype == HM_BF16)
    hm_block8(st, r0, g, n, k, v, qrows, bias, HM_BF16, next);
  else if (dtype == HM_F16)
    hm_block8(st, r0, g, n, k, v, qrows, bias, HM_F16, next);
  else
    hm_block8(st, r0, g, n, k, v, qrows, bias, HM_F32, next);
  return 1;
}
#endif

/* The register block path over fp32 rows (KIVI's unpacked keys, and its values unless `kv`
 * gives them packed: hm_block64 only), if this build has one. */
#if defined(HM_BLOCK64)
#define HM_BLOCK_ROWS(st, r0, g, n, k, v, q, bias, kv) \
  hm_block64_rows(st, r0, g, n, k, v, q, bias, 0, kv, NULL)
#elif defined(HM_BLOCK8)
#define HM_BLOCK_ROWS(st, r0, g, n, k, v, q, bias, kv) \
  ((void)(kv), hm_block8_rows(st, r0, g, n, k, v, q, bias, HM_F32, NULL))
#endif

#ifdef HM_BLOCK64
#define HM_TILED 1
/* Keeps a vector in a register: the compiler may not fold its load into each FMA that uses it
 * (it did in the tiled scores: 4 query loads and 16 folded key loads a 16 FMAs, so the loads,
 * not the FMAs, set the pace; MLA's decode took 1.45x as long) */
#define HM_IN_REG(x) __asm__("" : "+v"(x))

/* A 4 x 4 scores tile's 16 dot products (acc, one vector of lane partials each: 4 * row + key)
 * into st->s, times `scale`: rows r0.., keys t0.. (a key past n is a repeat, not stored). */
static inline void hm_tile_sums(hm_state *st, __m512 *acc, int r0, int t0, int n, float scale) {
  float sums[16];
  _mm512_storeu_ps(sums, _mm512_mul_ps(hm_tree16(acc), _mm512_set1_ps(scale)));
  for (int j = 0; j < 16; j++) { /* lane j: vector HM_TREE16[j] */
    const int vec = HM_TREE16[j], t = t0 + (vec & 3);
    if (t < n) st->s[(size_t)(r0 + (vec >> 2)) * HM_MAX_BS + t] = sums[j];
  }
}

/* The register tiles of wide rows: MLA's latent rows (16 heads or more on one row of 576) and
 * block-heads of head_dim 128 and up. Where hm_scores loads a query vector per key vector and
 * the key rows once per query row, a scores tile of 4 query rows x 4 key rows loads 8 vectors
 * per 16 products and sums its 16 dot products at once (hm_tree16); a values tile holds 4 rows x
 * 64 columns of the accumulator in registers while the block's value rows stream past.
 *
 * Scores of one block's n key rows for the state's g query rows (g a multiple of 4, d of 16):
 * fp32 rows k against st->q, or with `dots` (AVX-512 BF16, d a multiple of 32) bf16 rows as they
 * lie against st->qb (the query rows unscaled in bf16) on vdpbf16ps, 32 channels an instruction
 * (twice the FMAs'; each product of two bf16 values is exact in fp32, so the scores are the fp32
 * path's up to the order of the sums), times `scale`. `next[t]`: row t of the next block (NULL:
 * none), in the pool's `esize`-byte elements; its lines are asked for while the first query
 * rows' scores run, one a chunk of channels, rather than in one burst (which stalled an AVX-512
 * core without AMX; see HM_KEYS_AHEAD). */
static void hm_tiled_scores(hm_state *st, int g, int n, const void *const *k,
                            const char *const *next, int esize, int dots, float scale) {
  const int d = st->d, ksize = dots ? 2 : 4; /* bytes of a key row's element */
  for (int t0 = 0; t0 < n; t0 += 4) {
    const char *kt[4], *pf[4];
    for (int j = 0; j < 4; j++) {
      kt[j] = (const char *)k[t0 + j < n ? t0 + j : n - 1]; /* a short tail repeats */
      pf[j] = next && t0 + j < n ? next[t0 + j] : NULL;
    }
    for (int r0 = 0; r0 < g; r0 += 4) {
      __m512 acc[16];
      for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
      /* i: the chunk's first channel; a chunk is one vector of each row (16 fp32, 32 bf16) */
      for (int i = 0; i < d; i += dots ? 32 : 16) {
        __m512i k0 = _mm512_loadu_si512(kt[0] + i * ksize);
        __m512i k1 = _mm512_loadu_si512(kt[1] + i * ksize);
        __m512i k2 = _mm512_loadu_si512(kt[2] + i * ksize);
        __m512i k3 = _mm512_loadu_si512(kt[3] + i * ksize);
        HM_IN_REG(k0);
        HM_IN_REG(k1);
        HM_IN_REG(k2);
        HM_IN_REG(k3);
        for (int r = 0; r < 4; r++) {
          __m512 *a = acc + 4 * r;
#ifdef __AVX512BF16__
          if (dots) {
            __m512i qv = _mm512_loadu_si512(st->qb + (size_t)(r0 + r) * d + i);
            HM_IN_REG(qv);
            a[0] = _mm512_dpbf16_ps(a[0], (__m512bh)qv, (__m512bh)k0);
            a[1] = _mm512_dpbf16_ps(a[1], (__m512bh)qv, (__m512bh)k1);
            a[2] = _mm512_dpbf16_ps(a[2], (__m512bh)qv, (__m512bh)k2);
            a[3] = _mm512_dpbf16_ps(a[3], (__m512bh)qv, (__m512bh)k3);
            continue;
          }
#endif
          __m512 qv = _mm512_loadu_ps(st->q + (size_t)(r0 + r) * d + i);
          HM_IN_REG(qv);
          a[0] = _mm512_fmadd_ps(qv, _mm512_castsi512_ps(k0), a[0]);
          a[1] = _mm512_fmadd_ps(qv, _mm512_castsi512_ps(k1), a[1]);
          a[2] = _mm512_fmadd_ps(qv, _mm512_castsi512_ps(k2), a[2]);
          a[3] = _mm512_fmadd_ps(qv, _mm512_castsi512_ps(k3), a[3]);
        }
        if (r0 == 0 && (i * esize) % 64 == 0) /* a line of each next row a chunk or two */
          for (int j = 0; j < 4; j++)
            if (pf[j]) __builtin_prefetch(pf[j] + i * esize, 0, 2);
      }
      hm_tile_sums(st, acc, r0, t0, n, scale);
    }
  }
}

/* Softmax of a block's scores (st->s) and its values: the first dv columns (a multiple of 64) of
 * its n rows v (fp32), in tiles of 4 query rows x 64 columns held in registers while the rows
 * stream past. */
static void hm_tiled_values(hm_state *st, int g, int n, const float *const *v) {
  const int d = st->d, dv = st->dv;
  hm_softmax_block(st, 0, g, n);
  for (int r0 = 0; r0 < g; r0 += 4) {
    const float *p = st->s + (size_t)r0 * HM_MAX_BS;
    for (int c = 0; c < dv; c += 64) {
      __m512 acc[16];
      for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++)
          acc[4 * r + j] = _mm512_loadu_ps(st->acc + (size_t)(r0 + r) * d + c + 16 * j);
      for (int t = 0; t < n; t++) {
        const float *vt = v[t] + c;
        __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16);
        __m512 v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
        HM_IN_REG(v0);
        HM_IN_REG(v1);
        HM_IN_REG(v2);
        HM_IN_REG(v3);
        for (int r = 0; r < 4; r++) {
          const __m512 pr = _mm512_set1_ps(p[(size_t)r * HM_MAX_BS + t]);
          acc[4 * r] = _mm512_fmadd_ps(pr, v0, acc[4 * r]);
          acc[4 * r + 1] = _mm512_fmadd_ps(pr, v1, acc[4 * r + 1]);
          acc[4 * r + 2] = _mm512_fmadd_ps(pr, v2, acc[4 * r + 2]);
          acc[4 * r + 3] = _mm512_fmadd_ps(pr, v3, acc[4 * r + 3]);
        }
      }
      for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++)
          _mm512_storeu_ps(st->acc + (size_t)(r0 + r) * d + c + 16 * j, acc[4 * r + j]);
    }
  }
}
#endif

/* Whether g query rows of the state go through the register tiles (hm_tiled_scores and
 * hm_tiled_values): rows wider than 64 (64 has its block paths), in fours, values in 64s */
static inline int hm_tiles_fit(const hm_state *st, int g) {
#ifdef HM_TILED
  return g % 4 == 0 && st->d > 64 && st->d % 16 == 0 && st->dv % 64 == 0;
#else
  (void)st, (void)g;
  return 0;
#endif
}

/* Whether tiled keys of `dtype` are scored as they lie on bf16 dot products: bf16 keys, a query
 * whose values are all bf16 (st->qb_scale), d a multiple of 32, a build with AVX-512 BF16 */
static inline int hm_tiles_dot(const hm_state *st, int tiled, int dtype) {
#if defined(HM_TILED) && defined(__AVX512BF16__)
  return tiled && st->qb_scale != 0.0f && dtype == HM_BF16 && st->d % 32 == 0;
#else
  (void)st, (void)tiled, (void)dtype;
  return 0;
#endif
}

/* A pool of full-precision blocks: k and v are [num_blocks, block_size, kv_heads, head_dim]
 * views with element strides (blk, tok, head) and unit stride along head_dim. */
typedef struct {
  const void *k, *v;
  int dtype;
  int64_t num_blocks, blk_stride, tok_stride, head_stride;
} hm_full_pool;

/* A layer of a KIVI pool: six fields, each `ptr[f] + block * blk_bytes[f]` then C-contiguous:
 * k_scale, k_zero [kg, kv_heads, head_dim] f16; v_scale, v_zero [block_size, kv_heads, vg] f16;
 * k_codes, v_codes [block_size, kv_heads, head_dim * bits / 8] u8. Key groups hold gk tokens,
 * value groups gv channels (see kernels/kivi.py). */
typedef struct {
  const void *const *ptr;
  const int64_t *blk_bytes;
  int64_t num_blocks;
  int bits, gk, vg, gv;
} hm_kivi_pool;

/* Where rows [0, n) of a block-head start (`base`: its first row, in elements of esize bytes),
 * keys into k and values into v, for the block paths that read them as they lie. */
static inline void hm_rows_at(const hm_full_pool *p, int64_t base, int n, int64_t esize,
                              const void **k, const void **v) {
  for (int t = 0; t < n; t++) {
    const int64_t off = (base + t * p->tok_stride) * esize;
    k[t] = (const char *)p->k + off;
    v[t] = (const char *)p->v + off;
  }
}

/* KV head h of sequence b's `len` tokens of a full pool, block by block; the state holds that
 * head's g query rows. 0, or 1 if the table names a block outside the pool. */
static int hm_full_blocks(hm_state *st, const hm_full_pool *p, const int32_t *table, int len,
                          int h, int g, int block_size) {
  const int d = st->d;
  const int64_t esize = p->dtype == HM_F32 ? 4 : 2;
  const float *krow[HM_MAX_BS], *vrow[HM_MAX_BS];
  const int tiled = hm_tiles_fit(st, g), dots = hm_tiles_dot(st, tiled, p->dtype);
  for (int j = 0; j * block_size < len; j++) {
    const int64_t blk = table[j];
    if (blk < 0 || blk >= p->num_blocks) return 1;
    const int n = len - j * block_size < block_size ? len - j * block_size : block_size;
    /* the next block's rows of this head only (a row is d values; the other heads' rows
     * between them are other work items'): spread over this block on the block paths that
     * read rows as they lie, else issued here */
    const int ahead = hm_next_block(table, j, len, block_size, p->num_blocks);
    const int64_t next_at =
        ahead ? (table[j + 1] * p->blk_stride + (int64_t)h * p->head_stride) * esize : 0;
    const hm_next_rows next = {(const char *)p->k + next_at, (const char *)p->v + next_at,
                               p->tok_stride * esize, d * esize};
    const int64_t base = blk * p->blk_stride + (int64_t)h * p->head_stride;
#ifdef HM_BLOCK64
    if (p->dtype == HM_BF16 && st->q_bf16 && d == 64 && n <= 16) {
      const void *kraw[16], *vraw[16];
      hm_rows_at(p, base, n, esize, kraw, vraw);
      if (hm_block64_rows(st, 0, g, n, kraw, vraw, NULL, NULL, 1, NULL, ahead ? &next : NULL))
        continue; /* (0 without AVX-512 BF16: the paths below) */
    }
#endif
#ifdef HM_BLOCK8
    if (d == 64 && n <= 16) { /* hm_block8 widens every dtype in registers */
      const void *kraw[16], *vraw[16];
      hm_rows_at(p, base, n, esize, kraw, vraw);
      if (hm_block8_rows(st, 0, g, n, kraw, vraw, st->q, NULL, p->dtype, ahead ? &next : NULL))
        continue;
    }
#endif
#ifdef HM_BLOCK64
    /* fp32 rows are read where they lie (hm_row widens nothing): prefetched as on the bf16
     * path */
    const int spread = ahead && p->dtype == HM_F32 && d == 64 && n <= 16;
#else
    const int spread = 0;
#endif
    if (ahead && !spread)
      for (int t = 0; t < block_size; t++) {
        hm_prefetch(next.k + t * next.stride, next.bytes);
        hm_prefetch(next.v + t * next.stride, next.bytes);
      }
    for (int t = 0; t < n; t++) {
      const int64_t off = (base + t * p->tok_stride) * esize;
      const char *kt = (const char *)p->k + off;
      krow[t] = dots ? (const float *)kt : hm_row(kt, p->dtype, d, st->kbuf + (size_t)t * d);
      vrow[t] = hm_row((const char *)p->v + off, p->dtype, d, st->vbuf + (size_t)t * d);
    }
#ifdef HM_TILED
    if (tiled) { /* (krow: bf16 rows as they lie where dots) */
      hm_tiled_scores(st, g, n, (const void *const *)krow, NULL, (int)esize, dots,
                      dots ? st->qb_scale : 1.0f);
      hm_tiled_values(st, g, n, vrow);
      continue;
    }
#endif
#ifdef HM_BLOCK64
    if (hm_block64_rows(st, 0, g, n, (const void *const *)krow, (const void *const *)vrow, st->q,
                        NULL, 0, NULL, spread ? &next : NULL))
      continue;
#endif
    for (int r = 0; r < g; r++)
      hm_scores(st->q + (size_t)r * d, krow, n, d, 0.0f, st->s + (size_t)r * HM_MAX_BS);
    hm_block_values(st, 0, g, n, vrow);
  }
  return 0;
}

/* A sequence's `len` latent rows of a pool with one KV head (MLA, absorbed: kernels/
 * mla_attention.py), block by block: each row [c_kv | k_rope] (d values) is the key of every
 * query row in the state, and its first dv values (c_kv) the value; a 16-bit row is widened once
 * for both; bf16 rows against a query of bf16 values (st->qb_scale) are scored on bf16 dot
 * products. 0, or 1 if the table names a block outside the pool. */
static int hm_latent_blocks(hm_state *st, const hm_full_pool *p, const int32_t *table, int len,
                            int block_size) {
  const int d = st->d, g = st->rows;
  const int64_t esize = p->dtype == HM_F32 ? 4 : 2;
  const float *row[HM_MAX_BS];
  const char *next[HM_MAX_BS];
  const int tiled = hm_tiles_fit(st, g), dots = hm_tiles_dot(st, tiled, p->dtype);
  for (int j = 0; j * block_size < len; j++) {
    const int64_t blk = table[j];
    if (blk < 0 || blk >= p->num_blocks) return 1;
    const int n = len - j * block_size < block_size ? len - j * block_size : block_size;
    const int ahead = hm_next_block(table, j, len, block_size, p->num_blocks);
    const int64_t nblk = ahead ? table[j + 1] : blk; /* (a block with a next one is full) */
    const void *raw[HM_MAX_BS];
    for (int t = 0; t < n; t++) {
      const int64_t off = (blk * p->blk_stride + t * p->tok_stride) * esize;
      raw[t] = (const char *)p->k + off;
      /* the bf16 dot products read the keys as they lie: only the values are widened */
      row[t] = hm_row(raw[t], p->dtype, dots ? st->dv : d, st->kbuf + (size_t)t * d);
      next[t] = (const char *)p->k + (nblk * p->blk_stride + t * p->tok_stride) * esize;
    }
#ifdef HM_TILED
    if (tiled) {
      hm_tiled_scores(st, g, n, dots ? raw : (const void *const *)row, ahead ? next : NULL,
                      (int)esize, dots, dots ? st->qb_scale : 1.0f);
      hm_tiled_values(st, g, n, row);
      continue;
    }
#endif
    if (ahead)
      for (int t = 0; t < n; t++) hm_prefetch(next[t], d * esize);
    for (int r = 0; r < g; r++)
      hm_scores(st->q + (size_t)r * d, row, n, d, 0.0f, st->s + (size_t)r * HM_MAX_BS);
    hm_softmax_block(st, 0, g, n);
    for (int r = 0; r < g; r++)
      hm_accumulate(st->acc + (size_t)r * d, st->s + (size_t)r * HM_MAX_BS, row, n, st->dv);
  }
  return 0;
}

#if defined(HM_BLOCK64) && defined(__AVX512BF16__)
#define HM_HEADS_TOGETHER 1
/* hm_full_blocks for every KV head of one sequence at once, block by block: a block's rows of all
 * heads are read while they are hot and in address order (the next block prefetched ahead),
 * where a work item per head reads every third row of a block (three KV heads) and leaves the
 * rest to another thread's item. For bf16 blocks of head_dim 64 and at most 16 rows, the state
 * holding all of the sequence's query rows in bf16 (the caller checks). */
static int hm_full_blocks_heads(hm_state *st, const hm_full_pool *p, const int32_t *table,
                                int len, int kv_heads, int g, int block_size) {
  const int64_t esize = 2, d = st->d;
  for (int j = 0; j * block_size < len; j++) {
    const int64_t blk = table[j];
    if (blk < 0 || blk >= p->num_blocks) return 1;
    const int n = len - j * block_size < block_size ? len - j * block_size : block_size;
    const int ahead = hm_next_block(table, j, len, block_size, p->num_blocks);
    const int64_t next_at = ahead ? table[j + 1] * p->blk_stride * esize : 0;
    for (int h = 0; h < kv_heads; h++) {
      /* the next block's rows of head h, prefetched while this block's head h is worked on
       * (hm_block64 spreads them over its value rows) */
      const int64_t at = next_at + h * p->head_stride * esize;
      const hm_next_rows next = {(const char *)p->k + at, (const char *)p->v + at,
                                 p->tok_stride * esize, d * esize};
      const int64_t base = blk * p->blk_stride + (int64_t)h * p->head_stride;
      const void *kraw[16], *vraw[16];
      hm_rows_at(p, base, n, esize, kraw, vraw);
      hm_block64_rows(st, h * g, g, n, kraw, vraw, NULL, NULL, 1, NULL, ahead ? &next : NULL);
    }
  }
  return 0;
}
#endif

/* Where block `blk`'s six fields start in a KIVI pool (k_scale, k_zero, v_scale, v_zero,
 * k_codes, v_codes), and each field's bytes in one layer of a block. */
static inline void hm_kivi_fields(const hm_kivi_pool *p, int64_t blk, int kv_heads, int d,
                                  int block_size, const char **at, int64_t *bytes) {
  const int64_t kscale = (int64_t)((block_size + p->gk - 1) / p->gk) * kv_heads * d * 2;
  const int64_t vscale = (int64_t)block_size * kv_heads * p->vg * 2;
  const int64_t codes = (int64_t)block_size * kv_heads * (d * p->bits / 8);
  const int64_t field_bytes[6] = {kscale, kscale, vscale, vscale, codes, codes};
  for (int f = 0; f < 6; f++) {
    at[f] = (const char *)p->ptr[f] + blk * p->blk_bytes[f];
    if (bytes) bytes[f] = field_bytes[f];
  }
}

/* KV head h's n rows of one block of a KIVI pool (its fields at `at`), for the state's g query
 * rows [r0, r0 + g). Keys: q . k = (q * scale) . code + q . zero, per key group, so keys are
 * never dequantized; values are rebuilt a row at a time, or (hm_block64) never either: their
 * codes go against the probabilities scaled by each row's group scales. */
static void hm_kivi_block_head(hm_state *st, const hm_kivi_pool *p, const char *const *at, int n,
                               int kv_heads, int h, int g, int r0) {
  const int d = st->d, packed = d * p->bits / 8, gk = p->gk, vg = p->vg;
  const float *krow[HM_MAX_BS], *vrow[HM_MAX_BS];
  float *sc = st->scratch, *zr = st->scratch + d;
  const uint16_t *ks = (const uint16_t *)at[0], *kz = (const uint16_t *)at[1];
  const uint16_t *vsc = (const uint16_t *)at[2], *vze = (const uint16_t *)at[3];
  const uint8_t *kc = (const uint8_t *)at[4], *vc = (const uint8_t *)at[5];
  const float *q = st->q + (size_t)r0 * d;
#ifdef HM_BLOCK_ROWS
  /* one key group: every row's q rescaled, a bias, then the register block path */
  const int one_group = gk >= n && d == 64 && n <= 16;
#endif
#ifdef HM_BLOCK64
  /* hm_block64 reads value rows as codes (their scales folded into the probabilities) */
  const int packed_values = one_group && p->gv % 16 == 0;
  hm_kivi_values kv = {.bits = p->bits, .gv = p->gv, .group_stride = kv_heads * vg};
#endif
  for (int t = 0; t < n; t++) {
    float *kr = st->kbuf + (size_t)t * d, *vr = st->vbuf + (size_t)t * d;
    const int64_t row = (int64_t)t * kv_heads + h, goff = row * vg;
    hm_unpack(kc + row * packed, p->bits, d, kr);
    krow[t] = kr;
#ifdef HM_BLOCK64
    if (packed_values) { /* the value row as it lies */
      kv.codes[t] = vc + row * packed;
      kv.scale[t] = vsc + goff;
      kv.zero[t] = vze + goff;
      continue;
    }
#endif
    hm_unpack(vc + row * packed, p->bits, d, vr);
    hm_halves(vsc + goff, vg, sc);
    hm_halves(vze + goff, vg, zr);
    hm_affine(vr, sc, zr, d, p->gv);
    vrow[t] = vr;
  }
#ifdef HM_BLOCK_ROWS
  if (one_group) {
    float bias[HM_MAX_GROUP];
    hm_halves(ks + (int64_t)h * d, d, sc);
    hm_halves(kz + (int64_t)h * d, d, zr);
    for (int m0 = 0; m0 < g; m0 += HM_MAX_GROUP) {
      const int m = g - m0 < HM_MAX_GROUP ? g - m0 : HM_MAX_GROUP;
      for (int r = 0; r < m; r++) {
        const float *qr = q + (size_t)(m0 + r) * d;
        float *qs = st->qs + (size_t)(m0 + r) * d;
#ifdef HM_BLOCK64
        /* d is 64 here: in four vectors, the bias's sum a tree (hm_dot's ended in a chain of
         * sixteen scalar adds, three times a block-head) */
        __m512 zq = _mm512_setzero_ps();
        for (int c = 0; c < 64; c += 16) {
          const __m512 qv = _mm512_loadu_ps(qr + c);
          _mm512_storeu_ps(qs + c, _mm512_mul_ps(qv, _mm512_loadu_ps(sc + c)));
          zq = _mm512_fmadd_ps(qv, _mm512_loadu_ps(zr + c), zq);
        }
        bias[r] = _mm512_reduce_add_ps(zq);
#else
        for (int i = 0; i < d; i++) qs[i] = qr[i] * sc[i];
        bias[r] = hm_dot(qr, zr, d);
#endif
      }
#ifdef HM_BLOCK64
      const hm_kivi_values *packed_kv = packed_values ? &kv : NULL;
#else
      const hm_kivi_values *packed_kv = NULL;
#endif
      HM_BLOCK_ROWS(st, r0 + m0, m, n, (const void *const *)krow, (const void *const *)vrow,
                    st->qs + (size_t)m0 * d, bias, packed_kv);
    }
    return;
  }
#endif
  for (int t0 = 0; t0 < n; t0 += gk) { /* one key group: rescale q by its scales */
    const int64_t off = ((int64_t)(t0 / gk) * kv_heads + h) * d;
    const int m = n - t0 < gk ? n - t0 : gk;
    hm_halves(ks + off, d, sc);
    hm_halves(kz + off, d, zr);
    for (int r = 0; r < g; r++) {
      const float *qr = q + (size_t)r * d;
      float *qs = st->qs + (size_t)r * d;
      for (int i = 0; i < d; i++) qs[i] = qr[i] * sc[i];
      hm_scores(qs, krow + t0, m, d, hm_dot(qr, zr, d),
                st->s + (size_t)(r0 + r) * HM_MAX_BS + t0);
    }
  }
  hm_block_values(st, r0 / g, g, n, vrow);
}

/* Sequence b's `len` tokens of a KIVI pool, KV head h, for the state's g query rows (a work item
 * per head). 0, or 1 if the table names a block outside the pool. */
static int hm_kivi_blocks(hm_state *st, const hm_kivi_pool *p, const int32_t *table, int len,
                          int kv_heads, int h, int g, int block_size) {
  for (int j = 0; j * block_size < len; j++) {
    const int64_t blk = table[j];
    if (blk < 0 || blk >= p->num_blocks) return 1;
    const int n = len - j * block_size < block_size ? len - j * block_size : block_size;
    const char *at[6];
    int64_t bytes[6];
    hm_kivi_fields(p, blk, kv_heads, st->d, block_size, at, bytes);
    if (hm_next_block(table, j, len, block_size, p->num_blocks)) {
      const char *next[6];
      hm_kivi_fields(p, table[j + 1], kv_heads, st->d, block_size, next, NULL);
      for (int f = 0; f < 6; f++) /* this layer's part of the field, C-contiguous in a block (the
                                     block stride may span every layer of a packed record) */
        hm_prefetch(next[f], bytes[f]);
    }
    hm_kivi_block_head(st, p, at, n, kv_heads, h, g, 0);
  }
  return 0;
}

/* hm_kivi_blocks for every KV head of one sequence at once, block by block: a block's fields of
 * all heads are read while they are hot and in address order, and the next block's fetched once
 * (a work item per head fetched every head's, three times over at three KV heads, and read a
 * third of each code row's lines). The state holds all of the sequence's query rows. */
static int hm_kivi_blocks_heads(hm_state *st, const hm_kivi_pool *p, const int32_t *table,
                                int len, int kv_heads, int g, int block_size) {
  for (int j = 0; j * block_size < len; j++) {
    const int64_t blk = table[j];
    if (blk < 0 || blk >= p->num_blocks) return 1;
    const int n = len - j * block_size < block_size ? len - j * block_size : block_size;
    const char *at[6], *next[6];
    int64_t bytes[6];
    hm_kivi_fields(p, blk, kv_heads, st->d, block_size, at, bytes);
    const int ahead = hm_next_block(table, j, len, block_size, p->num_blocks);
    if (ahead) hm_kivi_fields(p, table[j + 1], kv_heads, st->d, block_size, next, NULL);
    for (int h = 0; h < kv_heads; h++) {
      /* the next block's fields spread over this block's heads: a share before each head */
      if (ahead)
        for (int f = 0; f < 6; f++) {
          const int64_t part = (bytes[f] + kv_heads - 1) / kv_heads;
          const int64_t from = part * h, to = from + part < bytes[f] ? from + part : bytes[f];
          if (to > from) hm_prefetch(next[f] + from, to - from);
        }
      hm_kivi_block_head(st, p, at, n, kv_heads, h, g, h * g);
    }
  }
  return 0;
}

/* One work item per sequence, all its heads: its KIVI blocks (`kivi`, else none;
 * hm_kivi_blocks_heads), then its full-precision blocks (`full`, else none; hm_full_blocks_heads,
 * which takes bf16 blocks of head_dim 64 and at most 16 rows: the callers check). For where there
 * are enough sequences to keep every thread busy. Full blocks this way need a bf16 model's query
 * rows; a sequence with other rows goes head by head, a state each. Each query row meets the same
 * blocks in the same order as in a work item per head, so the results are the same bits. */
static int hm_sequences_heads(const float *q, const hm_kivi_pool *kivi, const int32_t *k_tables,
                              int64_t k_table_stride, const int32_t *k_lens, int k_block_size,
                              const hm_full_pool *full, const int32_t *f_tables,
                              int64_t f_table_stride, const int32_t *f_lens, int f_block_size,
                              int batch, int q_heads, int kv_heads, int head_dim, float scale,
                              int threads, float *out, float *lse) {
  const int g = q_heads / kv_heads;
  int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic)
  for (int b = 0; b < batch; b++) {
    const int64_t row0 = (int64_t)b * q_heads;
    const int32_t *kt = kivi ? k_tables + (int64_t)b * k_table_stride : NULL;
    const int32_t *ft = full ? f_tables + (int64_t)b * f_table_stride : NULL;
    hm_state st;
    if (!hm_begin(&st, q + row0 * head_dim, q_heads, g, head_dim, scale)) {
#pragma omp atomic write
      bad = -1;
      continue;
    }
    int fail = 0;
    if (full && !st.q_bf16) { /* head by head, each head's rows a state of their own */
      for (int h = 0; h < kv_heads && !fail; h++) {
        const int64_t r = row0 + (int64_t)h * g;
        if (!hm_begin(&st, q + r * head_dim, g, g, head_dim, scale)) {
          fail = -1;
          break;
        }
        fail = (kivi && hm_kivi_blocks(&st, kivi, kt, k_lens[b], kv_heads, h, g, k_block_size)) ||
               hm_full_blocks(&st, full, ft, f_lens[b], h, g, f_block_size);
        hm_finish(&st, out + r * head_dim, lse + r);
      }
    } else {
      if (kivi) fail = hm_kivi_blocks_heads(&st, kivi, kt, k_lens[b], kv_heads, g, k_block_size);
#ifdef HM_HEADS_TOGETHER
      if (!fail && full)
        fail = hm_full_blocks_heads(&st, full, ft, f_lens[b], kv_heads, g, f_block_size);
#endif
      hm_finish(&st, out + row0 * head_dim, lse + row0);
    }
    if (fail) {
#pragma omp atomic write
      bad = fail < 0 ? -1 : b + 1;
    }
  }
  return bad;
}

/* Whether full-precision blocks go a sequence a work item (hm_sequences_heads): bf16 blocks of
 * head_dim 64 and at most 16 rows, in a build with that path, with at least two sequences a
 * thread. */
static int hm_full_heads_together(int dtype, int head_dim, int block_size, int batch,
                                  int threads) {
#ifdef HM_HEADS_TOGETHER
  return dtype == HM_BF16 && head_dim == 64 && block_size <= 16 && batch >= 2 * threads;
#else
  (void)dtype, (void)head_dim, (void)block_size, (void)batch, (void)threads;
  return 0;
#endif
}

/* The three entry points: over a full pool, a KIVI pool, or a KIVI pool then each sequence's
 * full-precision window (one online softmax over both: the exact merge, in place). One work item
 * is one (sequence b, KV head h) with that head's g query rows: a single sequence still keeps
 * every thread busy. Outputs out [B, QH, D], lse [B, QH] fp32. Returns 0, 1 + the index of a
 * sequence whose table names a block outside its pool, or -1 when out of memory. */
#define HM_SEQUENCES(BODY)                                                                   \
  const int g = q_heads / kv_heads;                                                          \
  int bad = 0;                                                                               \
  _Pragma("omp parallel for num_threads(threads) schedule(dynamic)")                         \
  for (int item = 0; item < batch * kv_heads; item++) {                                      \
    const int b = item / kv_heads, h = item % kv_heads;                                      \
    const int64_t row0 = (int64_t)b * q_heads + (int64_t)h * g; /* its first query row */     \
    hm_state st;                                                                             \
    if (!hm_begin(&st, q + row0 * head_dim, g, g, head_dim, scale)) {                        \
      _Pragma("omp atomic write") bad = -1;                                                  \
      continue;                                                                              \
    }                                                                                        \
    int fail = 0;                                                                            \
    BODY                                                                                     \
    if (fail) {                                                                              \
      _Pragma("omp atomic write") bad = b + 1;                                               \
    }                                                                                        \
    hm_finish(&st, out + row0 * head_dim, lse + row0);                                       \
  }                                                                                          \
  return bad;

int hm_paged_attention_full(const float *q, const void *k, const void *v, int dtype,
                            int64_t num_blocks, int64_t blk_stride, int64_t tok_stride,
                            int64_t head_stride, const int32_t *tables, int64_t table_stride,
                            const int32_t *lens, int batch, int q_heads, int kv_heads,
                            int head_dim, int block_size, float scale, int threads, float *out,
                            float *lse) {
  const hm_full_pool pool = {k, v, dtype, num_blocks, blk_stride, tok_stride, head_stride};
  /* enough sequences to keep every thread busy: one work item per sequence, all heads */
  if (hm_full_heads_together(dtype, head_dim, block_size, batch, threads))
    return hm_sequences_heads(q, NULL, NULL, 0, NULL, 0, &pool, tables, table_stride, lens,
                              block_size, batch, q_heads, kv_heads, head_dim, scale, threads, out,
                              lse);
  HM_SEQUENCES(fail = hm_full_blocks(&st, &pool, tables + (int64_t)b * table_stride, lens[b], h,
                                     g, block_size);)
}

/* Absorbed MLA over a latent pool: rows [num_blocks, block_size, 1, head_dim] (strides blk,
 * tok), every one of a sequence's q_heads query rows (head_dim each) attending over its rows as
 * keys and over their first value_dim columns as values. One work item is one sequence (the
 * caller splits long sequences into several, kernels/native_attention.py). Outputs
 * out [B, QH, value_dim], lse [B, QH] fp32; returns as the other entry points. */
int hm_paged_attention_latent(const float *q, const void *rows, int dtype, int64_t num_blocks,
                              int64_t blk_stride, int64_t tok_stride, const int32_t *tables,
                              int64_t table_stride, const int32_t *lens, int batch, int q_heads,
                              int head_dim, int value_dim, int block_size, float scale,
                              int threads, float *out, float *lse) {
  const hm_full_pool pool = {rows, rows, dtype, num_blocks, blk_stride, tok_stride, 0};
  int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic)
  for (int b = 0; b < batch; b++) {
    const int64_t row0 = (int64_t)b * q_heads;
    hm_state st;
    if (!hm_begin(&st, q + row0 * head_dim, q_heads, q_heads, head_dim, scale)) {
#pragma omp atomic write
      bad = -1;
      continue;
    }
    st.dv = value_dim;
    if (hm_latent_blocks(&st, &pool, tables + (int64_t)b * table_stride, lens[b], block_size)) {
#pragma omp atomic write
      bad = b + 1;
    }
    hm_finish(&st, out + row0 * value_dim, lse + row0);
  }
  return bad;
}

int hm_paged_attention_kivi(const float *q, const void *const *ptr, const int64_t *blk_bytes,
                            int64_t num_blocks, int bits, int gk, int vg, int gv,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens,
                            int batch, int q_heads, int kv_heads, int head_dim, int block_size,
                            float scale, int threads, float *out, float *lse) {
  const hm_kivi_pool pool = {ptr, blk_bytes, num_blocks, bits, gk, vg, gv};
  if (batch >= 2 * threads) /* a sequence a work item, all its heads */
    return hm_sequences_heads(q, &pool, tables, table_stride, lens, block_size, NULL, NULL, 0,
                              NULL, 0, batch, q_heads, kv_heads, head_dim, scale, threads, out,
                              lse);
  HM_SEQUENCES(fail = hm_kivi_blocks(&st, &pool, tables + (int64_t)b * table_stride, lens[b],
                                     kv_heads, h, g, block_size);)
}

int hm_paged_attention_kivi_window(
    const float *q, const void *const *ptr, const int64_t *blk_bytes, int64_t num_blocks, int bits,
    int gk, int vg, int gv, const int32_t *tables, int64_t table_stride, const int32_t *lens,
    const void *wk, const void *wv, int wdtype, int64_t w_num_blocks, int64_t w_blk_stride,
    int64_t w_tok_stride, int64_t w_head_stride, const int32_t *w_tables, int64_t w_table_stride,
    const int32_t *w_lens, int w_block_size, int batch, int q_heads, int kv_heads, int head_dim,
    int block_size, float scale, int threads, float *out, float *lse) {
  const hm_kivi_pool pool = {ptr, blk_bytes, num_blocks, bits, gk, vg, gv};
  const hm_full_pool window = {wk,           wv,           wdtype,       w_num_blocks,
                               w_blk_stride, w_tok_stride, w_head_stride};
  if (hm_full_heads_together(wdtype, head_dim, w_block_size, batch, threads))
    return hm_sequences_heads(q, &pool, tables, table_stride, lens, block_size, &window, w_tables,
                              w_table_stride, w_lens, w_block_size, batch, q_heads, kv_heads,
                              head_dim, scale, threads, out, lse);
  HM_SEQUENCES(
      fail = hm_kivi_blocks(&st, &pool, tables + (int64_t)b * table_stride, lens[b], kv_heads, h,
                            g, block_size) ||
             hm_full_blocks(&st, &window, w_tables + (int64_t)b * w_table_stride, w_lens[b], h, g,
                            w_block_size);)
}
