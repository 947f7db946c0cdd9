/* XXH3-64 (seed 0, the default secret) of an input longer than 240 bytes, taken while the input
 * is copied: each 64-byte stripe is loaded once, stored to the copy and folded into the hash from
 * the same register. Why: the store's shared-memory get and put copy every block and checksum
 * each layer; copying a layer and then hashing it from cache made the second pass over L2 cost
 * ~25% of the copy (bench/kvstore.py's 64 MiB of 256 KiB blocks: 23-25 GB/s read+write, fused
 * 29-34, numpy's memcpy of the same bytes 24-34 on the 2-core EPYC).
 *
 * The algorithm is xxHash's long-input XXH3-64 as its specification gives it (xxhash_spec.md):
 * eight 64-bit accumulators; for each 64-byte stripe s of a 1,024-byte block, lane i takes
 * v = the stripe's u64 i and k = v ^ secret[8 s + 8 i ..], acc[i ^ 1] += v and acc[i] +=
 * lo32(k) * hi32(k); after each full block the accumulators are scrambled with the secret's last
 * 64 bytes; the last (partial) block's stripes as before, then the input's last 64 bytes with the
 * secret at 192 - 64 - 7; the accumulators merged in pairs (128-bit product folded) from secret
 * offset 11, seeded with len * PRIME64_1, and avalanched. tests/test_kvstore_copy.py checks it
 * against the `xxhash` package (whose function hashes every input here of 240 bytes or less, and
 * every header) at lengths around each boundary.
 *
 * Built where the compiler targets AVX-512 or AVX2 (HM_XXH3_FUSED); elsewhere the caller copies
 * and then hashes with the package's function. */

#ifndef HM_XXH3_H
#define HM_XXH3_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define HM_XXH3_FUSED 1

/* Shorter inputs take XXH3's other (short-input) branches. */
#define HM_XXH3_MIN_LONG 241

static const uint8_t hm_xxh3_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define HM_XXH3_PRIME32_1 0x9E3779B1U
#define HM_XXH3_PRIME64_1 0x9E3779B185EBCA87ULL

/* The eight accumulators: one register of AVX-512, two of AVX2 (lanes 0-3, 4-7). */
#ifdef __AVX512F__
typedef struct { __m512i a; } hm_xxh3_acc;

static inline hm_xxh3_acc hm_xxh3_init(void) {
  return (hm_xxh3_acc){_mm512_setr_epi64(
      0xC2B2AE3DULL, 0x9E3779B185EBCA87ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
      0x85EBCA77C2B2AE63ULL, 0x85EBCA77ULL, 0x27D4EB2F165667C5ULL, 0x9E3779B1ULL)};
}

static inline __m512i hm_xxh3_round512(__m512i acc, __m512i v, const uint8_t *key) {
  const __m512i k = _mm512_xor_si512(v, _mm512_loadu_si512(key));
  const __m512i prod = _mm512_mul_epu32(k, _mm512_srli_epi64(k, 32));
  /* acc[i ^ 1] += v: the stripe with each pair of lanes swapped */
  const __m512i swap = _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
  return _mm512_add_epi64(prod, _mm512_add_epi64(acc, swap));
}

/* One stripe copied from s to d and folded in. */
static inline void hm_xxh3_copy_stripe(hm_xxh3_acc *acc, uint8_t *d, const uint8_t *s,
                                       const uint8_t *key) {
  const __m512i v = _mm512_loadu_si512(s);
  _mm512_storeu_si512(d, v);
  acc->a = hm_xxh3_round512(acc->a, v, key);
}

static inline void hm_xxh3_stripe(hm_xxh3_acc *acc, const uint8_t *p, const uint8_t *key) {
  acc->a = hm_xxh3_round512(acc->a, _mm512_loadu_si512(p), key);
}

static inline void hm_xxh3_scramble(hm_xxh3_acc *acc) {
  const __m512i prime = _mm512_set1_epi32((int)HM_XXH3_PRIME32_1);
  __m512i a = _mm512_xor_si512(acc->a, _mm512_srli_epi64(acc->a, 47));
  a = _mm512_xor_si512(a, _mm512_loadu_si512(hm_xxh3_secret + 192 - 64));
  /* a * PRIME32_1 in 64 bits, from 32x32 products of each half */
  const __m512i lo = _mm512_mul_epu32(a, prime);
  const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
  acc->a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

static inline void hm_xxh3_lanes(const hm_xxh3_acc *acc, uint64_t out[8]) {
  _mm512_storeu_si512(out, acc->a);
}
#else
typedef struct { __m256i a[2]; } hm_xxh3_acc;

static inline hm_xxh3_acc hm_xxh3_init(void) {
  return (hm_xxh3_acc){{
      _mm256_setr_epi64x(0xC2B2AE3DLL, (long long)0x9E3779B185EBCA87ULL,
                         (long long)0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9LL),
      _mm256_setr_epi64x((long long)0x85EBCA77C2B2AE63ULL, 0x85EBCA77LL,
                         0x27D4EB2F165667C5LL, 0x9E3779B1LL)}};
}

static inline __m256i hm_xxh3_round256(__m256i acc, __m256i v, const uint8_t *key) {
  const __m256i k = _mm256_xor_si256(v, _mm256_loadu_si256((const __m256i *)key));
  const __m256i prod = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));
  const __m256i swap = _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2));
  return _mm256_add_epi64(prod, _mm256_add_epi64(acc, swap));
}

static inline void hm_xxh3_copy_stripe(hm_xxh3_acc *acc, uint8_t *d, const uint8_t *s,
                                       const uint8_t *key) {
  for (int h = 0; h < 2; h++) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(s + 32 * h));
    _mm256_storeu_si256((__m256i *)(d + 32 * h), v);
    acc->a[h] = hm_xxh3_round256(acc->a[h], v, key + 32 * h);
  }
}

static inline void hm_xxh3_stripe(hm_xxh3_acc *acc, const uint8_t *p, const uint8_t *key) {
  for (int h = 0; h < 2; h++)
    acc->a[h] = hm_xxh3_round256(
        acc->a[h], _mm256_loadu_si256((const __m256i *)(p + 32 * h)), key + 32 * h);
}

static inline void hm_xxh3_scramble(hm_xxh3_acc *acc) {
  const __m256i prime = _mm256_set1_epi32((int)HM_XXH3_PRIME32_1);
  for (int h = 0; h < 2; h++) {
    __m256i a = _mm256_xor_si256(acc->a[h], _mm256_srli_epi64(acc->a[h], 47));
    a = _mm256_xor_si256(
        a, _mm256_loadu_si256((const __m256i *)(hm_xxh3_secret + 192 - 64 + 32 * h)));
    const __m256i lo = _mm256_mul_epu32(a, prime);
    const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
    acc->a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
  }
}

static inline void hm_xxh3_lanes(const hm_xxh3_acc *acc, uint64_t out[8]) {
  _mm256_storeu_si256((__m256i *)out, acc->a[0]);
  _mm256_storeu_si256((__m256i *)(out + 4), acc->a[1]);
}
#endif

static inline uint64_t hm_xxh3_read64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* d[0, len) = s[0, len); returns XXH3-64 of those bytes. len >= HM_XXH3_MIN_LONG. */
static inline uint64_t hm_xxh3_copy(uint8_t *d, const uint8_t *s, size_t len) {
  hm_xxh3_acc acc = hm_xxh3_init();
  const size_t blocks = (len - 1) / 1024;
  size_t o = 0;
  for (size_t b = 0; b < blocks; b++) {
    for (int k = 0; k < 16; k++, o += 64)
      hm_xxh3_copy_stripe(&acc, d + o, s + o, hm_xxh3_secret + 8 * k);
    hm_xxh3_scramble(&acc);
  }
  const size_t stripes = (len - 1 - o) / 64;
  for (size_t k = 0; k < stripes; k++, o += 64)
    hm_xxh3_copy_stripe(&acc, d + o, s + o, hm_xxh3_secret + 8 * k);
  /* the last 1-64 bytes copied; the last stripe (overlapping the one before) hashed from the
   * copy, so the sum is of what landed in d even if s changed meanwhile */
  memcpy(d + o, s + o, len - o);
  hm_xxh3_stripe(&acc, d + len - 64, hm_xxh3_secret + 192 - 64 - 7);
  uint64_t lanes[8];
  hm_xxh3_lanes(&acc, lanes);
  uint64_t h = (uint64_t)len * HM_XXH3_PRIME64_1;
  for (int i = 0; i < 4; i++) {
    const uint8_t *key = hm_xxh3_secret + 11 + 16 * i;
    const __uint128_t p = (__uint128_t)(lanes[2 * i] ^ hm_xxh3_read64(key)) *
                          (lanes[2 * i + 1] ^ hm_xxh3_read64(key + 8));
    h += (uint64_t)p ^ (uint64_t)(p >> 64);
  }
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  return h ^ (h >> 32);
}
#endif

#endif
