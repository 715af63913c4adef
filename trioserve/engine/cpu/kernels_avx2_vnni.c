/* The kernels' AVX2 with AVX-VNNI path (Intel's client CPUs since Alder Lake,
   its servers since Sapphire Rapids, AMD's since Zen 5): kernels_avx2.c's
   arithmetic, with the 4-bit matmul's byte products summed by the
   VEX-encoded vpdpbusd instead of maddubs, madd and adds. The integers are
   the same, so the bits are too (kernels_vec_avx2.h). Compiled by target
   pragmas like the other paths; kernels.c runs it only where cpuid reports
   AVX-VNNI. GCC 11 and clang 12 were the first to know the instruction: an
   older compiler builds the library without this path. */

#if defined(__x86_64__)

#define Q4_ROWS 8 /* kernels_avx2.c's */
#define SUM16_ROWS 1 /* kernels_avx2.c's */
#define I8_ROWS 6 /* kernels_avx2.c's */
#include "kernels.h"

#if KERNELS_HAVE_AVX2_VNNI

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif

#include <math.h>

#define KERNELS_AVX2_VNNI 1
#include "kernels_vec_avx2.h"

#define KERNEL_PATH kernels_avx2_vnni
#define KERNEL_PATH_NAME "avx2-vnni"
#include "kernels_arith.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
#endif
