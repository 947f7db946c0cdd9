/* The library's entry points that its own kernels call too (decode_step.c chains them): each is
 * declared once here, and the files that define them include it, so the compiler checks that a
 * definition and its callers agree. */
#ifndef HM_KERNELS_H
#define HM_KERNELS_H

#include <stdint.h>

int hm_linear(const float *x, int64_t ldx, int m, const float *panels, int n, int k, float *out,
              int64_t ldo, int add, int threads);
int hm_linear_bf16(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels, int n, int k,
                   uint16_t *out, int64_t ldo, int add, int threads, int amx_min_rows);
int hm_linear_silu_bf16(const uint16_t *x, int64_t ldx, int m, const uint16_t *panels, int n,
                        int k, uint16_t *out, int64_t ldo, int threads, int amx_min_rows);
void hm_rms_norm(const float *x, int64_t ldx, int rows, int dim, const float *w, float eps,
                 float *out, int64_t ldo, int threads);
void hm_rms_norm_bf16(const uint16_t *x, int64_t ldx, int rows, int dim, const uint16_t *w,
                      float eps, uint16_t *out, int64_t ldo, int threads);
void hm_silu_mul(const float *gu, int64_t ldg, int rows, int inter, float *out, int64_t ldo,
                 int threads);
void hm_silu_mul_bf16(const uint16_t *gu, int64_t ldg, int rows, int inter, uint16_t *out,
                      int64_t ldo, int threads);
void hm_rope(void *x, int64_t ldx, int64_t ldh, int rows, int heads, int d, const void *cos,
             const void *sin, int dtype, int threads);
void hm_rope_row(void *x, int64_t ldx, int64_t ldh, int n, int heads, int d, const void *cos,
                 const void *sin, int dtype);
int hm_paged_attention_full(const float *q, const void *k, const void *v, int dtype,
                            int64_t num_blocks, int64_t blk_stride, int64_t tok_stride,
                            int64_t head_stride, const int32_t *tables, int64_t table_stride,
                            const int32_t *lens, int batch, int q_heads, int kv_heads,
                            int head_dim, int block_size, float scale, int threads, float *out,
                            float *lse);
int hm_paged_attention_latent(const float *q, const void *rows, int dtype, int64_t num_blocks,
                              int64_t blk_stride, int64_t tok_stride, const int32_t *tables,
                              int64_t table_stride, const int32_t *lens, int batch, int q_heads,
                              int head_dim, int value_dim, int block_size, float scale,
                              int threads, float *out, float *lse);
int hm_paged_attention_kivi_window(
    const float *q, const void *const *ptr, const int64_t *blk_bytes, int64_t num_blocks, int bits,
    int gk, int vg, int gv, const int32_t *tables, int64_t table_stride, const int32_t *lens,
    const void *wk, const void *wv, int wdtype, int64_t w_num_blocks, int64_t w_blk_stride,
    int64_t w_tok_stride, int64_t w_head_stride, const int32_t *w_tables, int64_t w_table_stride,
    const int32_t *w_lens, int w_block_size, int batch, int q_heads, int kv_heads, int head_dim,
    int block_size, float scale, int threads, float *out, float *lse);
int hm_linear_available(void);
int hm_linear_bf16_available(void);

#endif
