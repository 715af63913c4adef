/* What trioserve's native CPU kernels share across their instruction-set
   paths: the layouts, the limits, the scalar bfloat16 rounding, and the
   table of functions each path exports (kernels.c picks one at run time).

   The arithmetic itself is written once, in kernels_arith.h, against a
   16-lane vector interface (kernels_vec_*.h); each path's file
   (kernels_avx512.c, kernels_avx2_vnni.c, kernels_avx2.c, kernels_neon_dotprod.c,
   kernels_neon.c)
   compiles it for its instructions. Every
   path computes the same operations in the same order, lane for lane, so
   they give the same bits (tests/test_native.py compares them where a CPU
   runs more than one). */

#ifndef TRIOSERVE_KERNELS_H
#define TRIOSERVE_KERNELS_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

#define GROUP 32
#define WIDE 16        /* groups of one wide block: a lane each */
#define WIDE_BYTES 256 /* 16 groups x 16 bytes, as 4 loads of 64 */
#define NARROW 4       /* groups of one narrow block (the tail) */
#define NARROW_BYTES 64
#define ROWS 6 /* rows of x sharing one pass over the 4-bit W (of 4, 6 and 8, \
                  the fastest at 8 and 64 rows when measured) */
/* The same for the 4-bit matmul, at most 8; a path may choose its own
   (before including this file). */
#ifndef Q4_ROWS
#define Q4_ROWS ROWS
#endif
/* Row blocks of the 4-bit matmul up to this many rows sum each output's
   lanes 16 outputs at once (vf_reduce_add16: the same bits); larger ones
   one output at a time. A path may choose its own. */
#ifndef SUM16_ROWS
#define SUM16_ROWS Q4_ROWS
#endif
#define OUTS 16 /* outputs per unit of parallel work */
/* Rows of x sharing one pass over a block of the 8-bit matmul's weights, at
   most 8: each holds an integer accumulator, so a path with few registers
   chooses fewer (before including this file). */
#ifndef I8_ROWS
#define I8_ROWS 8
#endif
/* How far ahead of its reads a thread asks for the weights: one core keeps
   too few misses in flight for the memory's bandwidth on its own, and 4 KiB
   ahead was the distance that shortened a decode step's 4-bit matmuls most
   where it was tried. A prefetch past the end of the weights is harmless
   (it never faults). */
#define PREFETCH 4096
/* __builtin_prefetch's locality for the weights: 3 (keep in every cache
   level) unless a path sets its own before including this header. */
#ifndef WEIGHT_PREFETCH_LOCALITY
#define WEIGHT_PREFETCH_LOCALITY 3
#endif

/* The most query heads one KV head serves in the attention kernel (the
   per-head accumulators live on the stack). Python reads it
   (max_group_heads()) and says so in the log before a model with more falls
   back to torch's attention. */
#define MAX_GROUP_HEADS 8

/* The per-layer addresses forward_layers reads, in this order (an int64
   table the engine builds once at load). Python reads the names
   (layer_fields()) and builds its rows by them, so the two cannot drift. */
#define LAYER_FIELDS(X)                                                                      \
    X(attn_norm) X(qkv) X(qkv_d) X(qkv_m) X(o) X(o_d) X(o_m) X(mlp_norm) X(gate_up) X(gate_up_d) \
        X(gate_up_m) X(down) X(down_d) X(down_m)
#define LAYER_ENUM(name) L_##name,
enum { LAYER_FIELDS(LAYER_ENUM) L_FIELDS };
#undef LAYER_ENUM

/* forward_layers' arguments, in call order, each an address (ADDR), an
   integer (INT) or a float (REAL). Python reads the names (forward_args())
   and passes its values by them, so the two cannot disagree on the order;
   a name either side lacks fails the kernels' check at load. */
#define FORWARD_ARGS(ADDR, INT, REAL)                                                            \
    ADDR(x) ADDR(table) ADDR(caches) ADDR(cos) ADDR(sin) ADDR(slots) ADDR(pos) INT(R) INT(D)       \
        INT(H) INT(K) INT(E) INT(F) INT(n_layers) INT(T) INT(S) INT(rope_length) INT(threads)      \
            REAL(eps) REAL(scale)

/* The weights' layout, per output (trioserve.engine.cpu.native.pack): K / 2
   bytes, a byte holding q[j] of a group in its low nibble and q[j + 16] in
   its high one. The first 16 * (G / 16) groups (G = K / 32) come in wide
   blocks of 16 groups, 256 bytes: 4 loads of 64 bytes, load t holding, for
   each group l of the block in turn, its bytes 4t .. 4t + 3; so that after
   the 8 multiply-adds of a wide block, lane l of the sum is group l's whole
   dot product, and one conversion and one multiply-add per 16 groups apply
   the scales. The last G % 16 groups follow in narrow blocks of 4 groups,
   16 bytes each, a group after another (the last one may be short).

   Per row of x, after quantization (the same order): for each wide block,
   4 x (64 bytes of x8[4t .. 4t + 3] of each group, then 64 bytes of
   x8[16 + 4t .. 16 + 4t + 3]), 512 bytes, then the same 512 of r8; for
   each narrow block, 64 bytes of the groups' x8[0 .. 15], 64 of x8[16 ..
   31], then the same 128 of r8. dx (here dx / 128): 16 floats per wide
   block (one a group), 16 per narrow block (lane l: group l / 4); sx =
   (dx / 128) * sum(128 * x8 + r8): 16 floats per wide block, 4 per narrow
   one. Groups past K are zero (as is what they multiply). */
typedef struct {
    const int8_t *q;
    const float *dx;
    const float *sx;
} qrow;

typedef struct {
    int64_t groups, wide, narrow; /* G, wide blocks, narrow blocks (the last maybe short) */
    size_t qbytes, dfloats, sfloats;
} shape;

static inline shape shape_of(int64_t K) {
    shape s;
    s.groups = K / GROUP;
    s.wide = s.groups / WIDE;
    s.narrow = (s.groups % WIDE + NARROW - 1) / NARROW;
    s.qbytes = (size_t)(s.wide * 4 * WIDE_BYTES + s.narrow * 4 * NARROW_BYTES);
    s.dfloats = (size_t)(s.wide * 16 + s.narrow * 16);
    s.sfloats = (size_t)(s.wide * 16 + s.narrow * 4);
    return s;
}

/* float32 -> bfloat16, nearest even; every NaN becomes the one quiet NaN
   0x7fc0, as torch's conversion does (x86 and ARM make NaNs of different
   signs from the same operations: this keeps every path's bits equal). The
   vector paths' stores (vf_store_bf16) compute exactly this. */
#define BF16_NAN 0x7fc0u
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)BF16_NAN;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

typedef struct {
    const uint16_t *qkv;        /* [R, (H + 2K) * E], before rope */
    const float *cos, *sin;     /* [T_rope, E] */
    uint16_t *cache;            /* [S, 2K, T, E] */
    const int64_t *slots, *pos; /* [R] */
    uint16_t *q;                /* [R, H, E], after rope (scratch) */
    uint16_t *out;              /* [R, H * E] */
    int64_t R, H, K, E, T;
    float scale;
} attn_args;

/* One instruction-set path: what kernels.c calls. Each returns 0, or -1
   when an allocation failed (nothing then written past what was done). */
typedef struct {
    const char *name;
    int (*q4_matmul)(const uint16_t *x, const uint8_t *w, const uint16_t *d, const uint16_t *m,
                     uint16_t *out, int64_t M, int64_t N, int64_t K, int threads);
    int (*int8_matmul)(const uint16_t *x, const int8_t *q, const uint16_t *scale, void *out,
                       int out_bf16, int64_t M, int64_t N, int64_t K, int threads);
    void (*add_norm)(float *x, const uint16_t *y, const float *w, uint16_t *out, int64_t M,
                     int64_t D, float eps, int threads);
    int (*attention)(attn_args *a, int threads);
    void (*silu_mul)(const uint16_t *gu, uint16_t *out, int64_t R, int64_t F, int threads);
    int (*layers)(float *x, int64_t R, int64_t D, int64_t H, int64_t K, int64_t E, int64_t F,
                  int64_t n_layers, const int64_t *table, const int64_t *caches, int64_t T,
                  const float *cos, const float *sin, const int64_t *slots, const int64_t *pos,
                  float eps, float scale, int threads);
} kernel_path;

#if defined(__x86_64__)
/* AVX-VNNI's target and intrinsic: GCC 11, clang 12 (kernels_avx2_vnni.c). */
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define KERNELS_HAVE_AVX2_VNNI 1
#else
#define KERNELS_HAVE_AVX2_VNNI 0
#endif
extern const kernel_path kernels_avx512;
#if KERNELS_HAVE_AVX2_VNNI
extern const kernel_path kernels_avx2_vnni;
#endif
extern const kernel_path kernels_avx2;
#elif defined(__aarch64__)
extern const kernel_path kernels_neon_dotprod;
extern const kernel_path kernels_neon;
#endif

#endif
