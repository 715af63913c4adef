/* The kernels' ARM64 NEON path with the dot-product instructions (sdot:
   ARMv8.2 and later, where the CPU has them): kernels_arith.h compiled for
   these instructions (kernels.c runs this one only where the CPU has them). */

#if defined(__aarch64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif

#include <math.h>

/* One row's outputs summed 16 at once, as on AVX2 (kernels_avx2.c: there
   more rows spilled registers); not timed on an ARM64 CPU. */
#define SUM16_ROWS 1
/* 4 rows a pass over the 8-bit matmul's weights: 16 accumulators of the 32
   registers, with the weights' 4 and the products'; not timed on ARM64. */
#define I8_ROWS 4
#include "kernels.h"
#define KERNELS_DOTPROD 1
#include "kernels_vec_neon.h"

#define KERNEL_PATH kernels_neon_dotprod
#define KERNEL_PATH_NAME "neon-dotprod"
#include "kernels_arith.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
