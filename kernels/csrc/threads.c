/* Free the calling thread's OpenMP worker threads (they are made again by its next parallel
 * region). Why: libgomp (torch's too: the process has one) keeps a pool of workers per thread that
 * has opened a parallel region, and once the pools' threads outnumber the CPUs it stops spinning
 * at its barriers and sleeps on them: a worker whose model loaded and calibrated on its main
 * thread, then ran steps on a thread of their own, forked and joined 2-3x slower on 2 cores. */
#include <omp.h>

#include "hm_kernels.h"

int hm_release_threads(void) { return omp_pause_resource_all(omp_pause_soft); }
