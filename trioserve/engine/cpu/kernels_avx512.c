/* The kernels' AVX-512 (F, BW, VL, VNNI, BF16) with FMA and F16C path: kernels_arith.h compiled for these instructions
   (target pragmas, so one build with the usual flags holds every path;
   kernels.c runs this one only where the CPU has them). */

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")
#endif

#include <math.h>

/* Every row block's outputs summed 16 at once (kernels.h's SUM16_ROWS, by
   default): measured on a Zen 4 EPYC, two builds alternated in one process,
   the 4-bit matmuls took 0.87 to 1.0 of the time at 1 row and 0.89 to 1.0 at
   8 (the same bits; the machine's neighbours moved the figure run to run). */
#include "kernels.h"
#include "kernels_vec_avx512.h"

#define KERNEL_PATH kernels_avx512
#define KERNEL_PATH_NAME "avx512"
#include "kernels_arith.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
