/* Every entry point of the library, and the structs they take: declared once here, and every
 * source file includes it, so the compiler checks that a definition and its callers (decode_step.c
 * chains the others) agree. The Python side's ctypes table (kernels/native_abi.py) and structs
 * (kernels/decode_step.py) are checked against this file by tests/test_kernels_abi.py: a change
 * here that they do not follow fails there, not at run time. */
#ifndef HM_KERNELS_H
#define HM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* The checksum copy's hash (the `xxhash` package's XXH3-64, found by kernels/native_copy.py). */
typedef uint64_t (*hm_hash_fn)(const void *data, size_t len);

/* The model's shapes. */
typedef struct {
  int32_t num_layers, hidden, q_heads, kv_heads, head_dim, inter;
  float eps, scale;
} hm_llama_shape;

/* The pool: layer l's K of block b at k0 + b * blk_stride + l * layer_stride (elements of the
 * model's dtype), its V `kv_offset` elements further on. */
typedef struct {
  void *k0;
  int64_t num_blocks, blk_stride, layer_stride, kv_offset, tok_stride, head_stride;
  int32_t block_size;
} hm_llama_pool;

/* A KIVI pool's packed blocks (decode_attention.c's hm_kivi_pool), for a step whose `pool` is
 * the full-precision window: layer l's six fields start layer_bytes * l after layer 0's. Each
 * sequence attends over its packed tokens [0, lens[b]) (blocks tables[b]), then its window. */
typedef struct {
  const void *const *ptr0;
  const int64_t *blk_bytes;
  int64_t layer_bytes, num_blocks;
  int32_t bits, gk, vg, gv, block_size;
  const int32_t *tables;
  int64_t table_cols;
  const int32_t *lens;
} hm_llama_kivi;

/* Scratch the caller allocated: h [B, hidden], qkv [B, q + 2 kv], qf and attn_f [B, QH, D] fp32,
 * lse [B, QH] fp32, attn [B, QH * D] (bf16 only), gu [B, 2 I], act [B, I]. */
typedef struct {
  void *h, *qkv;
  float *qf, *attn_f, *lse;
  void *attn, *gu, *act;
} hm_llama_scratch;


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
int hm_linear_bf16_amx_available(void);
void hm_linear_pack(const float *w, int n, int k, float *panels, int threads);
void hm_linear_bf16_pack(const uint16_t *w, int n, int k, uint16_t *panels, int threads);
void hm_argmax_f32(const float *x, int64_t ldx, int rows, int64_t n, int64_t *out, int threads);
int hm_release_threads(void);
int hm_paged_attention_kivi(const float *q, const void *const *ptr, const int64_t *blk_bytes,
                            int64_t num_blocks, int bits, int gk, int vg, int gv,
                            const int32_t *tables, int64_t table_stride, const int32_t *lens,
                            int batch, int q_heads, int kv_heads, int head_dim, int block_size,
                            float scale, int threads, float *out, float *lse);
int hm_prefill_attention_bf16(const uint16_t *q, int64_t q_tok, int64_t q_head, const uint16_t *k,
                              const uint16_t *v, int64_t block_stride, int64_t tok_stride,
                              int64_t head_stride, const int64_t *table, int64_t block_size,
                              int t, int start, int q_heads, int kv_heads, int d, float scale,
                              uint16_t *out, int64_t out_stride, int threads, int amx);
int hm_prefill_attention_bf16_available(void);
int hm_prefill_attention_f32(const float *q, int64_t q_tok, int64_t q_head, const float *k,
                             const float *v, int64_t block_stride, int64_t tok_stride,
                             int64_t head_stride, const int64_t *table, int64_t block_size, int t,
                             int start, int q_heads, int kv_heads, int d, float scale, float *out,
                             int64_t out_stride, int threads);
int hm_prefill_attention_f32_available(void);
void hm_copy_hashed(uint8_t *dst, const int64_t *dst_off, const uint8_t *src,
                    const int64_t *src_off, int64_t count, int64_t n, int64_t layer_bytes,
                    hm_hash_fn hash, uint64_t *sums, int threads);
int64_t hm_copy_checked(uint8_t *dst, const int64_t *dst_off, const uint8_t *src,
                        const int64_t *hdr_off, int64_t count, const uint8_t *tmpl,
                        int64_t prefix_len, int64_t table_off, int64_t hsum_off,
                        int64_t header_len, int64_t n, int64_t layer_bytes, hm_hash_fn hash,
                        int32_t *why);
void hm_seal_headers(uint8_t *dst, const int64_t *off, int64_t count, const uint8_t *fixed,
                     int64_t fixed_len, const uint64_t *sums, int64_t layers, int64_t header_len,
                     hm_hash_fn hash);
int hm_llama_decode_layers(int dtype, const hm_llama_shape *s, const void *const *layers,
                           const hm_llama_pool *pool, const int32_t *tables, int64_t table_cols,
                           const int64_t *positions, const int32_t *lens, int batch,
                           const void *cos, const void *sin, void *x, const hm_llama_scratch *w,
                           const hm_llama_kivi *kivi, int threads, int amx_min_rows);

#endif
