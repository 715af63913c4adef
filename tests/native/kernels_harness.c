/* Runs every native kernel of one instruction-set path on fixed
   pseudo-random inputs (the shapes take each branch: wide and narrow 4-bit
   blocks and a short last one, ragged row counts, grouped and ungrouped
   heads, silu's extremes and a NaN) and writes every output, in order, to
   stdout. Built without Python against the kernels' sources, it runs where
   Python and torch cannot: an ARM64 path under qemu-user on an x86-64
   machine (tests/test_native_paths.py). Every path must write the same bytes.

       harness PATH    (PATH: one of the names this build holds; "list" lists them) */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static const kernel_path *const paths[] = {
#if defined(__x86_64__)
    &kernels_avx512,
#if KERNELS_HAVE_AVX2_VNNI
    &kernels_avx2_vnni,
#endif
    &kernels_avx2,
#elif defined(__aarch64__)
    &kernels_neon_dotprod, &kernels_neon,
#endif
};

static uint64_t state = 0x9e3779b97f4a7c15ull;
static uint32_t next(void) { /* xorshift64* */
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return (uint32_t)((state * 0x2545f4914f6cdd1dull) >> 32);
}
static float uniform(void) { return (float)(next() >> 8) / 16777216.0f; } /* [0, 1) */
/* Roughly normal (four uniforms), and that times 2^-4 .. 2^1 (magnitudes
   spread so that the order of a sum's terms changes its rounding, small
   enough that attention's softmax does not pick one position): float adds
   and multiplies alone, so that every machine draws the same inputs (libm's
   functions may differ in the last bit from one machine to another).
   Each draw is its own statement: C leaves the order of the operands of +
   and * unspecified, and another compiler would draw other inputs. */
static float normal(void) {
    float a = uniform();
    float b = uniform();
    float c = uniform();
    float d = uniform();
    return (a + b + c + d - 2.0f) * 1.7f;
}
static float spread(void) {
    float x = normal();
    uint32_t k = next() % 6;
    return x * (float)(1u << k) / 16.0f;
}
static uint16_t bf(float f) { return float_to_bf16(f); }

static void emit(const void *p, size_t bytes) {
    if (fwrite(p, 1, bytes, stdout) != bytes) exit(3);
}
static void *need(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) exit(2);
    return p;
}

static void q4_case(const kernel_path *k, int64_t N, int64_t K, int64_t M) {
    uint8_t *w = need((size_t)(N * K / 2));
    uint16_t *d = need((size_t)(N * K / 32) * 2), *m = need((size_t)(N * K / 32) * 2);
    uint16_t *x = need((size_t)(M * K) * 2), *out = need((size_t)(M * N) * 2);
    for (int64_t i = 0; i < N * K / 2; i++) w[i] = (uint8_t)next();
    for (int64_t i = 0; i < N * K / 32; i++) {
        d[i] = (uint16_t)(0x1800 + next() % 0x400);           /* float16, about 0.002 */
        m[i] = (uint16_t)(0x8000 | (0x2000 + next() % 0x400)); /* about -0.008 */
    }
    for (int64_t i = 0; i < M * K; i++) x[i] = bf(normal() * 3.0f);
    if (M >= 5) { /* a row with a NaN and one whose groups are nearly zero (127 / max overflows) */
        x[K + 7] = (uint16_t)BF16_NAN;
        for (int64_t i = 0; i < K; i++) x[2 * K + i] = bf(normal() * 1e-38f);
    }
    if (k->q4_matmul(x, w, d, m, out, M, N, K, 2)) exit(4);
    emit(out, (size_t)(M * N) * 2);
    free(w), free(d), free(m), free(x), free(out);
}

int main(int argc, char **argv) {
    if (argc != 2) return 64;
    const kernel_path *k = NULL;
    for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) {
        if (strcmp(argv[1], "list") == 0) printf("%s\n", paths[i]->name);
        else if (strcmp(argv[1], paths[i]->name) == 0) k = paths[i];
    }
    if (strcmp(argv[1], "list") == 0) return 0;
    if (!k) return 65;

    const int64_t shapes[][2] = {{80, 576}, {16, 96}, {33, 608}, {7, 4256}};
    const int64_t rows[] = {1, 5, 13};
    for (int s = 0; s < 4; s++)
        for (int r = 0; r < 3; r++) q4_case(k, shapes[s][0], shapes[s][1], rows[r]);

    /* the 8-bit matmul (pack_int8's blocks of 16 outputs: any bytes do), in
       float32 and in bfloat16; K = 1040 runs past one integer chunk, and one
       row there holds an infinity */
    const int64_t i8[][3] = {{100, 576, 7}, {37, 1040, 9}};
    for (int s = 0; s < 2; s++) {
        int64_t N = i8[s][0], K = i8[s][1], M = i8[s][2], padded = (N + 15) / 16 * 16;
        int8_t *q = need((size_t)(padded * K));
        uint16_t *scale = need((size_t)N * 2), *x = need((size_t)(M * K) * 2);
        float *out = need((size_t)(M * N) * 4);
        uint16_t *out16 = need((size_t)(M * N) * 2);
        for (int64_t i = 0; i < padded * K; i++) q[i] = (int8_t)((int)(next() % 255) - 127);
        for (int64_t i = 0; i < N; i++) scale[i] = bf(uniform() * 0.01f);
        for (int64_t i = 0; i < M * K; i++) x[i] = bf(normal());
        if (s == 1) x[3 * K + 77] = bf(INFINITY);
        if (s == 0) {
            /* a row of tiny values: 32767 / its largest would overflow */
            for (int64_t i = 0; i < K; i++) x[2 * K + i] = i % 3 ? bf(normal() * 1e-38f) : 0;
            /* the largest integer sums: the first block's weights +-127, a
               row all at +-its largest; and a row of exact half steps (amax / 2) */
            for (int64_t i = 0; i < 16 * K; i++) q[i] = (int8_t)(i % 7 ? 127 : -127);
            for (int64_t i = 0; i < K; i++) x[4 * K + i] = bf(i % 5 ? 1.5f : -1.5f);
            for (int64_t i = 0; i < K; i++) x[5 * K + i] = bf(i % 2 ? 3.0f : (i % 4 ? 1.5f : -1.5f));
        }
        if (k->int8_matmul(x, q, scale, out, 0, M, N, K, 2)) exit(4);
        if (k->int8_matmul(x, q, scale, out16, 1, M, N, K, 2)) exit(4);
        emit(out, (size_t)(M * N) * 4), emit(out16, (size_t)(M * N) * 2);
        free(q), free(scale), free(x), free(out), free(out16);
    }
    { /* the residual add and norm, with and without the add */
        int64_t M = 19, D = 576;
        float *x = need((size_t)(M * D) * 4), *w = need((size_t)D * 4);
        uint16_t *y = need((size_t)(M * D) * 2), *out = need((size_t)(M * D) * 2);
        for (int64_t i = 0; i < M * D; i++) x[i] = normal() * 5.0f, y[i] = bf(normal());
        for (int64_t i = 0; i < D; i++) w[i] = uniform();
        k->add_norm(x, y, w, out, M, D, 1e-5f, 2);
        emit(out, (size_t)(M * D) * 2), emit(x, (size_t)(M * D) * 4);
        k->add_norm(x, NULL, w, out, M, D, 1e-5f, 2);
        emit(out, (size_t)(M * D) * 2);
        free(x), free(w), free(y), free(out);
    }
    { /* silu(gate) * up, extremes and a NaN included */
        int64_t R = 9, F = 1536;
        uint16_t *gu = need((size_t)(R * 2 * F) * 2), *out = need((size_t)(R * F) * 2);
        for (int64_t i = 0; i < R * 2 * F; i++) gu[i] = bf(normal() * 6.0f);
        const float extremes[] = {100.0f, -100.0f, 88.0f, -88.0f, 1e30f, NAN, INFINITY, -INFINITY};
        for (int i = 0; i < 8; i++) gu[i] = bf(extremes[i]);
        k->silu_mul(gu, out, R, F, 2);
        emit(out, (size_t)(R * F) * 2);
        free(gu), free(out);
    }
    { /* silu(gate) * up for every bfloat16 gate (up = 1) */
        int64_t R = 2, F = 32768;
        uint16_t *gu = need((size_t)(R * 2 * F) * 2), *out = need((size_t)(R * F) * 2);
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < F; i++) {
                gu[r * 2 * F + i] = (uint16_t)(r * F + i);
                gu[r * 2 * F + F + i] = 0x3f80; /* 1.0 */
            }
        k->silu_mul(gu, out, R, F, 2);
        emit(out, (size_t)(R * F) * 2);
        free(gu), free(out);
    }
    /* rope, the cache write and attention */
    /* the last: 48 rows (a score's last bit moves a bfloat16 output rarely) */
    const int64_t heads[][4] = {{9, 3, 64, 6}, {8, 1, 128, 6}, {4, 4, 96, 6}, {8, 1, 256, 48}};
    for (int c = 0; c < 4; c++) {
        int64_t H = heads[c][0], KV = heads[c][1], E = heads[c][2], R = heads[c][3], T = 300, S = 3;
        float *cs = need((size_t)(T * E) * 4), *sn = need((size_t)(T * E) * 4);
        uint16_t *cache = need((size_t)(S * 2 * KV * T * E) * 2);
        uint16_t *qkv = need((size_t)(R * (H + 2 * KV) * E) * 2), *out = need((size_t)(R * H * E) * 2);
        for (int64_t i = 0; i < T * E; i++) cs[i] = normal(), sn[i] = normal();
        for (int64_t i = 0; i < S * 2 * KV * T * E; i++) cache[i] = bf(spread());
        for (int64_t i = 0; i < R * (H + 2 * KV) * E; i++) qkv[i] = bf(spread());
        int64_t slots[48], pos[48];
        const int64_t first[] = {0, 17, 5, 290, 63, 64};
        for (int64_t r = 0; r < R; r++) {
            slots[r] = R == 6 ? r / 2 : r % S;
            pos[r] = R == 6 ? first[r] : 100 + 4 * r + r % S; /* distinct (slot, position) */
        }
        attn_args a = {.qkv = qkv, .cos = cs, .sin = sn, .cache = cache, .slots = slots, .pos = pos,
                       .out = out, .R = R, .H = H, .K = KV, .E = E, .T = T,
                       .scale = 1.0f / sqrtf((float)E)};
        if (k->attention(&a, 2)) exit(4);
        emit(out, (size_t)(R * H * E) * 2), emit(cache, (size_t)(S * 2 * KV * T * E) * 2);
        free(cs), free(sn), free(cache), free(qkv), free(out);
    }
    return 0;
}
