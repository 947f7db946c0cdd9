/* A Llama-family decode step's decoder layers in one call: for each layer, RMSNorm, the fused
 * QKV matmul, RoPE on q and k, the new K/V written into the paged pool, paged attention over
 * each sequence's blocks, the output projection added into the residual, RMSNorm, the fused
 * gate/up matmul, SiLU-and-multiply and the down projection added into the residual.
 *
 * Why one call: each of those steps is already one C pass (linear.c, linear_bf16.c, rope.c,
 * decode_attention.c), but driven from Python a layer cost ~40 tensor ops and 8 ctypes calls
 * around them (views, dtype checks, temporaries, index_put for the KV write): at SmolLM2's size
 * that was a third of a batch-16 step. Here the same functions run back to back over buffers the
 * caller allocated once, so the results are the Python path's bits (tests compare them).
 *
 * Everything the caller passes is checked before anything is written: every slot and every
 * table entry a sequence reaches must name a pool block, so a bad table changes nothing.
 */

#include <stdint.h>
#include <string.h>

#include "hm_bf16.h"
#include "hm_kernels.h"

enum { HM_STEP_F32 = 0, HM_STEP_BF16 = 1 };

/* Rows from which the step's own per-row passes (RoPE with the KV write, the attention output's
 * rounding) run on every thread: on one, the RoPE and KV write took ~13 us of a batch-16 layer
 * (its rows come from both threads' caches, its pool slots from memory) while the other thread
 * waited. */
#define HM_STEP_PARALLEL_ROWS 2

/* Per layer, in this order: input norm, qkv panels, o panels, post norm, gate/up panels, down
 * panels. */
enum { HM_LAYER_PTRS = 6 };

/* The step's argument structs (hm_llama_shape, _pool, _kivi, _scratch) are in hm_kernels.h. */


/* 0, or the first sequence (1-based) whose slot or table names a block outside the pool, or
 * whose position its table does not cover. */
static int hm_check_tables(const hm_llama_pool *pool, const int32_t *tables, int64_t table_cols,
                           const int64_t *positions, int batch, const hm_llama_kivi *kivi) {
  for (int b = 0; b < batch; b++) {
    if (kivi) {
      const int32_t n = kivi->lens[b], *t = kivi->tables + (int64_t)b * kivi->table_cols;
      if (n < 0 || (n + kivi->block_size - 1) / kivi->block_size > kivi->table_cols) return b + 1;
      for (int64_t j = 0; j * kivi->block_size < n; j++)
        if (t[j] < 0 || t[j] >= kivi->num_blocks) return b + 1;
    }
    const int64_t pos = positions[b];
    if (pos < 0 || pos / pool->block_size >= table_cols) return b + 1;
    const int32_t *t = tables + (int64_t)b * table_cols;
    for (int64_t j = 0; j <= pos / pool->block_size; j++)
      if (t[j] < 0 || t[j] >= pool->num_blocks) return b + 1;
  }
  return 0;
}

/* x [B, hidden] (the model's dtype, contiguous) carries the embeddings in and the last layer's
 * residual stream out. positions [B] int64: each sequence's new token's position in `pool` (its
 * KV is written there, and it attends over [0, pos] of it); tables [B, table_cols] int32; lens
 * [B] int32 = positions + 1; cos/sin [B, D/2] in the model's dtype, for the token's position in
 * its sequence. With `kivi` (else NULL), `pool` is each sequence's window after its packed
 * blocks. Returns 0; b + 1 for a bad table of
 * sequence b (nothing written); -1 where attention could not allocate its state; -2 where the
 * library lacks the dtype's path. */
int hm_llama_decode_layers(int dtype, const hm_llama_shape *s, const void *const *layers,
                           const hm_llama_pool *pool, const int32_t *tables, int64_t table_cols,
                           const int64_t *positions, const int32_t *lens, int batch,
                           const void *cos, const void *sin, void *x, const hm_llama_scratch *w,
                           const hm_llama_kivi *kivi, int threads, int amx_min_rows) {
  if (dtype == HM_STEP_BF16 ? !hm_linear_bf16_available() : !hm_linear_available()) return -2;
  const int bad = hm_check_tables(pool, tables, table_cols, positions, batch, kivi);
  if (bad) return bad;
  const int qh = s->q_heads, kvh = s->kv_heads, d = s->head_dim, hid = s->hidden;
  const int q_size = qh * d, kv_size = kvh * d, qkv_n = q_size + 2 * kv_size;
  const int64_t elt = dtype == HM_STEP_BF16 ? 2 : 4;
  char *const qkv = w->qkv;
  for (int l = 0; l < s->num_layers; l++) {
    const void *const *p = layers + (int64_t)l * HM_LAYER_PTRS;
    char *const k_layer = (char *)pool->k0 + l * pool->layer_stride * elt;
    char *const v_layer = k_layer + pool->kv_offset * elt;
    if (dtype == HM_STEP_BF16) {
      hm_rms_norm_bf16(x, hid, batch, hid, p[0], s->eps, w->h, hid, threads);
      hm_linear_bf16(w->h, hid, batch, p[1], qkv_n, hid, w->qkv, qkv_n, 0, threads,
                     amx_min_rows);
    } else {
      hm_rms_norm(x, hid, batch, hid, p[0], s->eps, w->h, hid, threads);
      hm_linear(w->h, hid, batch, p[1], qkv_n, hid, w->qkv, qkv_n, 0, threads);
    }
    /* a row per thread: q and k rotated in place (one run of q_heads + kv_heads heads), the
     * new K/V written into the pool, q widened to fp32 (as the attention kernel takes it) */
#pragma omp parallel for num_threads(threads) if (batch >= HM_STEP_PARALLEL_ROWS) schedule(static)
    for (int b = 0; b < batch; b++) {
      hm_rope_row(w->qkv, qkv_n, d, b, qh + kvh, d, cos, sin, dtype);
      const int64_t pos = positions[b];
      const int64_t blk = tables[(int64_t)b * table_cols + pos / pool->block_size];
      const int64_t slot = blk * pool->blk_stride + (pos % pool->block_size) * pool->tok_stride;
      const char *krow = qkv + ((int64_t)b * qkv_n + q_size) * elt;
      const char *vrow = krow + kv_size * elt;
      for (int h = 0; h < kvh; h++) {
        memcpy(k_layer + (slot + h * pool->head_stride) * elt, krow + h * d * elt, d * elt);
        memcpy(v_layer + (slot + h * pool->head_stride) * elt, vrow + h * d * elt, d * elt);
      }
      float *qf = w->qf + (int64_t)b * q_size;
      if (dtype == HM_STEP_BF16) {
        const uint16_t *qrow = (const uint16_t *)qkv + (int64_t)b * qkv_n;
#pragma omp simd
        for (int i = 0; i < q_size; i++) qf[i] = hm_bf16_scalar(qrow[i]);
      } else {
        memcpy(qf, (const float *)qkv + (int64_t)b * qkv_n, q_size * sizeof(float));
      }
    }
    int failed;
    if (kivi) {
      const void *fields[6];
      for (int f = 0; f < 6; f++) fields[f] = (const char *)kivi->ptr0[f] + l * kivi->layer_bytes;
      failed = hm_paged_attention_kivi_window(
          w->qf, fields, kivi->blk_bytes, kivi->num_blocks, kivi->bits, kivi->gk, kivi->vg,
          kivi->gv, kivi->tables, kivi->table_cols, kivi->lens, k_layer, v_layer, dtype,
          pool->num_blocks, pool->blk_stride, pool->tok_stride, pool->head_stride, tables,
          table_cols, lens, pool->block_size, batch, qh, kvh, d, kivi->block_size, s->scale,
          threads, w->attn_f, w->lse);
    } else {
      failed = hm_paged_attention_full(
          w->qf, k_layer, v_layer, dtype, pool->num_blocks, pool->blk_stride, pool->tok_stride,
          pool->head_stride, tables, table_cols, lens, batch, qh, kvh, d, pool->block_size,
          s->scale, threads, w->attn_f, w->lse);
    }
    if (failed) return failed; /* tables were checked: only an allocation can fail here */
    if (dtype == HM_STEP_BF16) {
      uint16_t *attn = w->attn;
#pragma omp parallel for num_threads(threads) if (batch >= HM_STEP_PARALLEL_ROWS) schedule(static)
      for (int b = 0; b < batch; b++) {
        const float *src = w->attn_f + (int64_t)b * q_size;
        uint16_t *dst = attn + (int64_t)b * q_size;
#pragma omp simd
        for (int i = 0; i < q_size; i++) dst[i] = hm_round_bf16(src[i]);
      }
      hm_linear_bf16(attn, q_size, batch, p[2], hid, q_size, x, hid, 1, threads, amx_min_rows);
      hm_rms_norm_bf16(x, hid, batch, hid, p[3], s->eps, w->h, hid, threads);
      if (hm_linear_silu_bf16(w->h, hid, batch, p[4], 2 * s->inter, hid, w->act, s->inter,
                              threads, amx_min_rows)) { /* no fused pass here: the two steps */
        hm_linear_bf16(w->h, hid, batch, p[4], 2 * s->inter, hid, w->gu, 2 * s->inter, 0,
                       threads, amx_min_rows);
        hm_silu_mul_bf16(w->gu, 2 * s->inter, batch, s->inter, w->act, s->inter, threads);
      }
      hm_linear_bf16(w->act, s->inter, batch, p[5], hid, s->inter, x, hid, 1, threads,
                     amx_min_rows);
    } else {
      hm_linear(w->attn_f, q_size, batch, p[2], hid, q_size, x, hid, 1, threads);
      hm_rms_norm(x, hid, batch, hid, p[3], s->eps, w->h, hid, threads);
      hm_linear(w->h, hid, batch, p[4], 2 * s->inter, hid, w->gu, 2 * s->inter, 0, threads);
      hm_silu_mul(w->gu, 2 * s->inter, batch, s->inter, w->act, s->inter, threads);
      hm_linear(w->act, s->inter, batch, p[5], hid, s->inter, x, hid, 1, threads);
    }
  }
  return 0;
}
