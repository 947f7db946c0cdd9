/* Blocks' bytes copied and each layer's checksum taken from the copy while it is still in cache:
 * the store's shared-memory get and put (kvstore/client/transport_shm.py) hand over a whole
 * batch of blocks in one call, instead of a Python loop of slices and hash calls per block and
 * layer.
 *
 * The checksum is xxHash's XXH3-64, the block format's. Where the compiler targets AVX-512 or
 * AVX2, a layer of more than 240 bytes is hashed as it is copied (hm_xxh3.h); elsewhere, and for
 * shorter layers and the headers, with the function the `xxhash` Python package carries
 * (kernels/native_copy.py finds it there and checks once that the two agree).
 */

#include <stdint.h>
#include <string.h>

#include "hm_kernels.h"
#include "hm_xxh3.h"

/* Where a layer is not hashed as it is copied (no AVX2, or a layer of 240 bytes or less):
 * up to this, a block is copied whole and then hashed layer by layer from cache; a bigger one
 * is copied and hashed a layer at a time, each layer hashed while its copy is in L1/L2. At 2 MiB
 * a 1 MiB block (source and copy: twice the L2 of the Zen 5 measured) was hashed from L3 after
 * its copy: bench/kvstore.py's 1 MiB shm put went 8.8-9.7 -> 11.0-12.7 GB/s and get 9.1-10.1 ->
 * 13.1-13.6 GB/s at 256 KiB (SmolLM2's bf16 block is 368 KiB); 256 KiB and 16 MiB unchanged. */
#define HM_WHOLE_COPY_BYTES (256 << 10)

/* For i < count: dst[dst_off[i] ..] = src[src_off[i] ..] (n bytes), and sums[i * layers + l] =
 * the hash of layer l of that copy (layers of layer_bytes, the last one possibly short). Blocks
 * are shared among `threads` where the batch holds at least HM_PARALLEL_COPY_BYTES. Why: a
 * prefill's layer-wise publish writes each layer of its new blocks into the store's shared
 * memory between two layers of the forward, while the forward's other threads wait; one thread
 * wrote 64 blocks' layer (786 KB of SmolLM2 bf16) to lines not in cache at ~3 GB/s, 245 us a
 * layer, 7 ms of a 1,024-token prefill on the 2-core AMX Xeon. */
#define HM_PARALLEL_COPY_BYTES (256 << 10)

void hm_copy_hashed(uint8_t *dst, const int64_t *dst_off, const uint8_t *src,
                    const int64_t *src_off, int64_t count, int64_t n, int64_t layer_bytes,
                    hm_hash_fn hash, uint64_t *sums, int threads) {
  const int64_t layers = (n + layer_bytes - 1) / layer_bytes;
#pragma omp parallel for num_threads(threads) if (threads > 1 && count > 1 && \
                                                      count * n >= HM_PARALLEL_COPY_BYTES) \
    schedule(static)
  for (int64_t i = 0; i < count; i++) {
    uint8_t *d = dst + dst_off[i];
    const uint8_t *s = src + src_off[i];
#ifdef HM_XXH3_FUSED
    /* every layer long enough for XXH3's long-input branch (the last may be short) */
    if (layer_bytes >= HM_XXH3_MIN_LONG && n - (layers - 1) * layer_bytes >= HM_XXH3_MIN_LONG) {
      for (int64_t l = 0; l < layers; l++) {
        const int64_t o = l * layer_bytes, len = n - o < layer_bytes ? n - o : layer_bytes;
        sums[i * layers + l] = hm_xxh3_copy(d + o, s + o, (size_t)len);
      }
      continue;
    }
#endif
    if (n <= HM_WHOLE_COPY_BYTES) memcpy(d, s, (size_t)n);
    for (int64_t l = 0; l < layers; l++) {
      const int64_t o = l * layer_bytes, len = n - o < layer_bytes ? n - o : layer_bytes;
      if (n > HM_WHOLE_COPY_BYTES) memcpy(d + o, s + o, (size_t)len);
      sums[i * layers + l] = hash(d + o, (size_t)len);
    }
  }
}

/* Blocks that carry their own checksums, copied and checked in one call: the shared-memory get's
 * path for a run of blocks of one layout, where a Python loop parsing each block's header cost
 * as much as the Lease call (256 blocks of 256 KiB: ~1.6 of 9.6 ms a get).
 *
 * Block i's header starts at src + hdr_off[i]: its first prefix_len bytes must equal `tmpl` (the
 * layout's fixed fields, as the caller parsed them from a block of the run), its hash of bytes
 * [0, hsum_off) must equal the u64 at hsum_off, and the u64 table at table_off holds each
 * layer's checksum. Its n payload bytes, from header_len on, are copied to dst + dst_off[i] and
 * each layer of the copy hashed (as hm_copy_hashed) against the table. Returns how many blocks
 * from the first passed; *why: 0 every block passed, 1 block [returned] has another header (the
 * caller reads it itself), 2 a layer of block [returned] failed its checksum (its copy is
 * scratch). The caller checked that every block lies inside src and dst. */
int64_t hm_copy_checked(uint8_t *dst, const int64_t *dst_off, const uint8_t *src,
                        const int64_t *hdr_off, int64_t count, const uint8_t *tmpl,
                        int64_t prefix_len, int64_t table_off, int64_t hsum_off,
                        int64_t header_len, int64_t n, int64_t layer_bytes, hm_hash_fn hash,
                        int32_t *why) {
  const int64_t layers = (n + layer_bytes - 1) / layer_bytes;
  uint64_t sums[1024];
  *why = 0;
  if (layers > 1024) { /* more layers than any model here: the caller's own loop */
    *why = 1;
    return 0;
  }
  for (int64_t i = 0; i < count; i++) {
    const uint8_t *h = src + hdr_off[i];
    uint64_t want;
    memcpy(&want, h + hsum_off, sizeof want);
    if (memcmp(h, tmpl, (size_t)prefix_len) || hash(h, (size_t)hsum_off) != want) {
      *why = 1;
      return i;
    }
    hm_copy_hashed(dst, dst_off + i, h + header_len, (const int64_t[]){0}, 1, n, layer_bytes,
                   hash, sums, 1);
    for (int64_t l = 0; l < layers; l++) {
      memcpy(&want, h + table_off + 8 * l, sizeof want);
      if (sums[l] != want) {
        *why = 2;
        return i;
      }
    }
  }
  return count;
}

/* The headers of blocks whose layers' checksums are known, written in one call: a put's commit,
 * where packing each header in Python cost ~1 ms of a 256-block put's ~11. Header i at dst +
 * off[i]: the layout's fixed fields (`fixed`, fixed_len bytes), the table of its layers'
 * checksums (sums[i * layers ..], little-endian u64 as the block format's), the hash of those two,
 * then zeros to header_len. The caller checked that every header lies inside dst. */
void hm_seal_headers(uint8_t *dst, const int64_t *off, int64_t count, const uint8_t *fixed,
                     int64_t fixed_len, const uint64_t *sums, int64_t layers, int64_t header_len,
                     hm_hash_fn hash) {
  const int64_t body = fixed_len + 8 * layers;
  for (int64_t i = 0; i < count; i++) {
    uint8_t *h = dst + off[i];
    memcpy(h, fixed, (size_t)fixed_len);
    memcpy(h + fixed_len, sums + i * layers, (size_t)(8 * layers));
    const uint64_t sum = hash(h, (size_t)body);
    memcpy(h + body, &sum, sizeof sum);
    memset(h + body + 8, 0, (size_t)(header_len - body - 8));
  }
}
