/* The kernels' ARM64 NEON path (ARMv8.0: every ARM64 CPU): kernels_arith.h
   compiled for these instructions (kernels.c runs this one only where the
   CPU has them). */

#if defined(__aarch64__)

#include <math.h>

/* One row's outputs summed 16 at once, as on AVX2 (kernels_avx2.c: there
   more rows spilled registers); not timed on an ARM64 CPU. */
#define SUM16_ROWS 1
/* 4 rows a pass over the 8-bit matmul's weights: 16 accumulators of the 32
   registers, with the weights' 4 and the products'; not timed on ARM64. */
#define I8_ROWS 4
#include "kernels.h"
#include "kernels_vec_neon.h"

#define KERNEL_PATH kernels_neon
#define KERNEL_PATH_NAME "neon"
#include "kernels_arith.h"

#endif
