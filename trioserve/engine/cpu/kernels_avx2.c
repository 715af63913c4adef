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
