/* AMX tile state, shared by the CPU kernels that use tiles (linear_bf16.c, prefill_attention.c).
 * Linux hands a process the tile registers only once it asks (arch_prctl, Linux >= 5.16); each
 * thread then loads a tile configuration before its first tile instruction and releases it after
 * its last. Include after defining _GNU_SOURCE. */
#ifndef HM_AMX_H
#define HM_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define HM_AMX 1

/* palette 1's configuration: rows and bytes per row of each of the 8 tiles */
typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} hm_tilecfg;

/* Load cfg into this thread's tile configuration. Not GCC 12's _tile_loadconfig: its asm tells
 * the compiler it reads only a pointer's 8 bytes of the 64, so the stores that fill the rest (a
 * memset) may be dropped as dead, and the CPU faults on the garbage left there (seen: SIGSEGV in
 * ldtilecfg at -O1). Here the operand is the whole struct. */
static inline void hm_tile_loadconfig(const hm_tilecfg *cfg) {
  __asm__ volatile("ldtilecfg %0" ::"m"(*cfg));
}

static int hm_amx_ready = -1; /* -1 unknown, 0 refused, 1 granted (per process) */

/* Ask the kernel for this process's AMX tile state; 1 when granted. */
static inline int hm_amx_request(void) {
  if (hm_amx_ready < 0) {
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    hm_amx_ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }
  return hm_amx_ready;
}
#endif

#endif
