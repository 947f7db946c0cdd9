/* Sixteen 16-lane vectors' lanes each combined into one value, all sixteen at once: shared by the
 * CPU kernels (decode_attention.c's scores, prefill_attention.c's softmax on AMX). */
#ifndef HM_TREE16_H
#define HM_TREE16_H

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

/* out = one vector whose lane j holds vector a[HM_TREE16[j]]'s sixteen lanes combined by OP
 * (_mm512_add_ps or _mm512_max_ps): a tree of 128-bit lane shuffles, then in-lane unpacks, 30
 * operations where sixteen horizontal reductions take about 130; the same order of operations
 * for every vector, so a vector's result does not depend on its place among the sixteen. */
#define HM_TREE16_OP(a, OP, out)                                                              \
  do {                                                                                        \
    __m512 x_[8], y_[4], z_[2];                                                               \
    for (int i_ = 0; i_ < 8; i_++)                                                            \
      x_[i_] = OP(_mm512_shuffle_f32x4((a)[i_], (a)[i_ + 8], 0x44),                           \
                  _mm512_shuffle_f32x4((a)[i_], (a)[i_ + 8], 0xEE));                          \
    for (int i_ = 0; i_ < 4; i_++)                                                            \
      y_[i_] = OP(_mm512_shuffle_f32x4(x_[i_], x_[i_ + 4], 0x88),                             \
                  _mm512_shuffle_f32x4(x_[i_], x_[i_ + 4], 0xDD));                            \
    for (int i_ = 0; i_ < 2; i_++)                                                            \
      z_[i_] = OP(_mm512_unpacklo_ps(y_[i_], y_[i_ + 2]),                                     \
                  _mm512_unpackhi_ps(y_[i_], y_[i_ + 2]));                                    \
    const __m512d lo_ = _mm512_unpacklo_pd(_mm512_castps_pd(z_[0]), _mm512_castps_pd(z_[1])); \
    const __m512d hi_ = _mm512_unpackhi_pd(_mm512_castps_pd(z_[0]), _mm512_castps_pd(z_[1])); \
    (out) = OP(_mm512_castpd_ps(lo_), _mm512_castpd_ps(hi_));                                 \
  } while (0)

/* The tree's lane j holds vector HM_TREE16[j]'s result (an involution): a row written to slot
 * HM_TREE16[t] comes out in lane t. */
static const int HM_TREE16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
#endif

#endif
