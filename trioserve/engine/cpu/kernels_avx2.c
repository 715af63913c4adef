/* The kernels' AVX2 with FMA and F16C path: kernels_arith.h compiled for these instructions
   (target pragmas, so one build with the usual flags holds every path;
   kernels.c runs this one only where the CPU has them). */

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include <math.h>

/* 8 rows a pass over the weights: with the weights unpacked once per pass
   (kernels_vec_avx2.h's wide_dots), 8 streams' decode step is one pass, not
   6 + 2 (when measured, 8 was faster than 6 at 1 to 64 rows). */
#define Q4_ROWS 8
/* One row's outputs summed 16 at once (kernels.h): measured on the AVX2 path
   of a Zen 4 EPYC, two builds alternated in one process, one row's 4-bit
   matmuls took 0.83 to 0.97 of the time (the same bits); from 4 rows on it
   was 6 to 25 % slower, the 16 registers spilling the more. */
#define SUM16_ROWS 1
/* 6 rows a pass over the 8-bit matmul's weights: 12 integer accumulators
   of the 16 registers. Measured on the AVX2 path of a Zen 4 EPYC, builds
   alternated call by call in one process, the 49152 x 576 projection at 8
   rows took 0.78 and 0.90 of 4 rows' time in two runs; 8 rows, 0.85 and
   1.13. */
#define I8_ROWS 6
/* Weights prefetched with the non-temporal hint: a step streams 95 MB of
   them, and with the default hint they pushed out what the Python between
   the native calls touches (the logits' recheck then took 0.44 ms a step
   instead of 0.26). One stream's engine step was 2 % faster on an AVX2-only
   EPYC (Zen 2), 8 streams' unchanged; not measured on the other paths. */
#define WEIGHT_PREFETCH_LOCALITY 0
#include "kernels.h"
#include "kernels_vec_avx2.h"

#define KERNEL_PATH kernels_avx2
#define KERNEL_PATH_NAME "avx2"
#include "kernels_arith.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
