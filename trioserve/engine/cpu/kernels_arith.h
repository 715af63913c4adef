/* The arithmetic of trioserve's native CPU kernels, written once against the
   16-lane vector interface (vf, vi, vb: kernels_vec_*.h) and compiled once
   per instruction-set path (kernels_avx512.c, kernels_avx2.c), which define
   KERNEL_PATH (the exported table's name) and KERNEL_PATH_NAME first. Every
   function here is static: each path has its own copy.

   The 4-bit matmul.

   out[M, N] (bfloat16) = x[M, K] (bfloat16) @ W[N, K].T, where W is held in
   GGUF's Q4_1 form: groups of 32 consecutive inputs of one output, each a
   4-bit q in [0, 15] with a scale d and a minimum m (float16), w = d * q + m.

   Each row of x is first written as integers per group of 32 (one float
   scale dx per group: its largest magnitude / 127): v = x / dx, x8 =
   round(v) and r8 = round((v - x8) * 128), both in 8 bits, so that x ~ dx *
   (x8 + r8 / 128) to within dx / 256 (15 bits against the group's largest
   value; bfloat16 itself keeps 8 per value). A group's dot product is then
   integer work: sum(q * (128 * x8 + r8)) = 128 * sum(q * x8) + sum(q * r8),
   unsigned 4-bit weights times signed 8-bit inputs summed four at a time
   (vpdpbusd on AVX-512, maddubs and madd on AVX2), exact in int32 and in the
   float32 it is converted to (below 2^24); what is rounded is in float32, in
   an order that depends on nothing but K:
       sum(w * x) ~ d * (dx / 128) * that + m * (dx / 128) * sum(128 * x8 + r8).
   llama.cpp keeps x8 alone (8 bits); on SmolLM2 that moves near-ties ("What
   is the capital of France?" is then answered "L'Etoile ...", by llama-server
   too): the residual keeps the answers of torch's bfloat16 path there.

   Batch invariance. A row's result is computed by the same instructions,
   in the same order, whatever M is, whichever other rows share its block
   (Q4_ROWS: kernels.h) and whichever thread computes it: rows are quantized alone, threads
   split the outputs (never K), and a block of fewer rows runs the same
   per-row sequence; the one exception, a block's outputs summed 16 at once
   (SUM16_ROWS) or one at a time, adds the same numbers in the same tree
   (vf_reduce_add16), so the bits are the same. So a job's logits do not depend on its companions, nor
   on whether its positions were computed in a prefill chunk or a decode step
   (trioserve.engine.cpu.llama relies on it; tests/test_native.py checks it). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if !defined(KERNELS_OWN_WIDE_DOT)
/* A wide block's dot products with nr rows: s[r] = 128 * (q . x8) + (q .
   r8) per group (lane) for row r, xq[r] its 1,024 bytes of the block
   (kernels.h's layout). The block's weights are unpacked once (both nibbles
   of its 4 loads) and serve every row. A vector interface with too few
   registers to hold them defines its own (and KERNELS_OWN_WIDE_DOT). */
static inline __attribute__((always_inline)) void wide_dots(const uint8_t *wb,
                                                            const int8_t *const *xq,
                                                            const int nr, vi *s) {
    vb w[8];
    for (int t = 0; t < 4; t++) {
        vb v = vb_load(wb + t * 64);
        w[2 * t] = vb_low(v);
        w[2 * t + 1] = vb_high(v);
    }
    for (int r = 0; r < nr; r++) {
        const int8_t *x8[8], *r8[8];
        for (int t = 0; t < 4; t++) {
            x8[2 * t] = xq[r] + t * 128;
            x8[2 * t + 1] = xq[r] + t * 128 + 64;
            r8[2 * t] = xq[r] + 512 + t * 128;
            r8[2 * t + 1] = xq[r] + 512 + t * 128 + 64;
        }
        s[r] = vi_add(vi_shl7(vi_dot(w, x8, 8)), vi_dot(w, r8, 8));
    }
}
#endif

#if !defined(KERNELS_OWN_NARROW_DOT)
/* A narrow block's dot products with nr rows, its first `present` groups
   (of 4) there (the rest zero): lane l of s[r] is group l / 4's part, xq[r]
   row r's 256 bytes of the block. */
static inline __attribute__((always_inline)) void narrow_dots(const uint8_t *wb, int present,
                                                              const int8_t *const *xq,
                                                              const int nr, vi *s) {
    vb v = vb_load_first(wb, present * 16);
    vb ws[2] = {vb_low(v), vb_high(v)};
    for (int r = 0; r < nr; r++) {
        const int8_t *x8[2] = {xq[r], xq[r] + NARROW_BYTES};
        const int8_t *r8[2] = {xq[r] + 128, xq[r] + 128 + NARROW_BYTES};
        s[r] = vi_add(vi_shl7(vi_dot(ws, x8, 2)), vi_dot(ws, r8, 2));
    }
}
#endif

static void quantize_row(const uint16_t *x, const shape *sh, int8_t *q, float *dx, float *sx) {
    memset(q, 0, sh->qbytes);
    memset(dx, 0, sh->dfloats * sizeof(float));
    memset(sx, 0, sh->sfloats * sizeof(float));
    int8_t *tail_q = q + sh->wide * 4 * WIDE_BYTES;
    float *tail_dx = dx + sh->wide * 16, *tail_sx = sx + sh->wide * 16;
    for (int64_t g = 0; g < sh->groups; g++) {
        const uint16_t *src = x + g * GROUP;
        vf a = vf_bf16(src), b = vf_bf16(src + 16);
        float amax = vf_reduce_max(vf_max(vf_abs(a), vf_abs(b)));
        float d = amax / 127.0f;
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        vf va = vf_mul(a, vf_set1(id)), vb_ = vf_mul(b, vf_set1(id));
        vi qa = vi_round(va), qb = vi_round(vb_);
        vf k128 = vf_set1(128.0f);
        vi ra = vi_round(vf_mul(vf_sub(va, vf_from_vi(qa)), k128));
        vi rb = vi_round(vf_mul(vf_sub(vb_, vf_from_vi(qb)), k128));
        int32_t total = vi_reduce_add(vi_add(vi_add(vi_shl7(qa), ra), vi_add(vi_shl7(qb), rb)));
        d = d / 128.0f;
        int8_t v[GROUP], rv[GROUP];
        vi_store_i8(v, qa);
        vi_store_i8(v + 16, qb);
        vi_store_i8(rv, ra);
        vi_store_i8(rv + 16, rb);
        if (g < sh->wide * WIDE) {
            int64_t block = g / WIDE, lane = g % WIDE;
            int8_t *dst = q + block * 4 * WIDE_BYTES + lane * 4;
            for (int t = 0; t < 4; t++) {
                memcpy(dst + t * 128, v + 4 * t, 4);
                memcpy(dst + t * 128 + 64, v + 16 + 4 * t, 4);
                memcpy(dst + 512 + t * 128, rv + 4 * t, 4);
                memcpy(dst + 512 + t * 128 + 64, rv + 16 + 4 * t, 4);
            }
            dx[block * 16 + lane] = d;
            sx[block * 16 + lane] = d * (float)total;
        } else {
            int64_t t = g - sh->wide * WIDE, block = t / NARROW, slot = t % NARROW;
            int8_t *dst = tail_q + block * 4 * NARROW_BYTES + slot * 16;
            memcpy(dst, v, 16);
            memcpy(dst + NARROW_BYTES, v + 16, 16);
            memcpy(dst + 128, rv, 16);
            memcpy(dst + 128 + NARROW_BYTES, rv + 16, 16);
            for (int l = 0; l < 4; l++) tail_dx[block * 16 + slot * 4 + l] = d;
            tail_sx[block * 4 + slot] = d * (float)total;
        }
    }
}

/* res[r] = row r of x (quantized) . one output's weights, for nr rows; nr is
   a constant at each call site (the loops over it unroll), and row r's
   arithmetic is the same for every nr. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *w, const uint16_t *d,
                                                           const uint16_t *m, const shape *sh,
                                                           const qrow *rows, const int nr,
                                                           vf (*sums)[OUTS], int64_t j,
                                                           uint16_t *out, int64_t N) {
    vf acc[Q4_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = vf_zero();
    for (int64_t b = 0; b < sh->wide; b++) {
        const uint8_t *wb = w + b * WIDE_BYTES;
        for (int t = 0; t < 4; t++)
            __builtin_prefetch(wb + PREFETCH + t * 64, 0, WEIGHT_PREFETCH_LOCALITY);
        const int8_t *xq[Q4_ROWS];
        for (int r = 0; r < nr; r++) xq[r] = rows[r].q + b * 4 * WIDE_BYTES;
        vi s[Q4_ROWS];
        wide_dots(wb, xq, nr, s);
        vf d16 = vf_f16(d + b * WIDE), m16 = vf_f16(m + b * WIDE);
        for (int r = 0; r < nr; r++) {
            vf scale = vf_mul(d16, vf_load(rows[r].dx + b * 16));
            acc[r] = vf_fmadd(vf_from_vi(s[r]), scale, acc[r]);
            acc[r] = vf_fmadd(m16, vf_load(rows[r].sx + b * 16), acc[r]);
        }
    }
    const uint8_t *tw = w + sh->wide * WIDE_BYTES;
    const uint16_t *td = d + sh->wide * WIDE, *tm = m + sh->wide * WIDE;
    int64_t left = sh->groups - sh->wide * WIDE;
    for (int64_t b = 0; b < sh->narrow; b++, left -= NARROW) {
        int present = left >= NARROW ? NARROW : (int)left;
        const int8_t *xq[Q4_ROWS];
        for (int r = 0; r < nr; r++) xq[r] = rows[r].q + sh->wide * 4 * WIDE_BYTES + b * 4 * NARROW_BYTES;
        vi s[Q4_ROWS];
        narrow_dots(tw + b * NARROW_BYTES, present, xq, nr, s);
        /* lane l: group l / 4's d; m in lanes 0-3 (one a group), zero above */
        vf d16 = vf_f16_spread4(td + b * NARROW, present), m16 = vf_f16_first4(tm + b * NARROW, present);
        for (int r = 0; r < nr; r++) {
            const float *dx = rows[r].dx + sh->wide * 16 + b * 16;
            const float *sx = rows[r].sx + sh->wide * 16 + b * 4;
            vf scale = vf_mul(d16, vf_load(dx));
            acc[r] = vf_fmadd(vf_from_vi(s[r]), scale, acc[r]);
            acc[r] = vf_fmadd(m16, vf_load_first4(sx), acc[r]);
        }
    }
    if (nr <= SUM16_ROWS) {
        /* summed across lanes by store_sums, 16 outputs at once */
        for (int r = 0; r < nr; r++) sums[r][j] = acc[r];
    } else {
        for (int r = 0; r < nr; r++) out[r * N + j] = float_to_bf16(vf_reduce_add(acc[r]));
    }
}

/* Rows r < nr of out (bfloat16, row stride N) from index 0 to count:
   each output's lanes summed (sums[r][j], vf_reduce_add's tree: the same
   bits whether 16 are summed at once or one at a time). */
static inline void store_sums(vf (*sums)[OUTS], int64_t nr, int64_t count, uint16_t *out, int64_t N) {
    if (nr > SUM16_ROWS) return; /* dot_rows stored them */
    for (int64_t r = 0; r < nr; r++) {
        if (count == OUTS) {
            vf_store_bf16(out + r * N, vf_reduce_add16(sums[r]));
        } else {
            for (int64_t j = 0; j < count; j++) out[r * N + j] = float_to_bf16(vf_reduce_add(sums[r][j]));
        }
    }
}

static int q4_matmul(const uint16_t *x, const uint8_t *w, const uint16_t *d, const uint16_t *m,
                     uint16_t *out, int64_t M, int64_t N, int64_t K, int threads) {
    shape sh = shape_of(K);
    size_t per_row = (sh.qbytes + (sh.dfloats + sh.sfloats) * sizeof(float) + 63) / 64 * 64;
    unsigned char *work = aligned_alloc(64, (size_t)M * per_row);
    qrow *rows = malloc((size_t)M * sizeof(qrow));
    if (!work || !rows) {
        free(work);
        free(rows);
        return -1;
    }
    for (int64_t r = 0; r < M; r++) {
        unsigned char *base = work + (size_t)r * per_row;
        rows[r].q = (const int8_t *)base;
        rows[r].dx = (const float *)(base + sh.qbytes);
        rows[r].sx = rows[r].dx + sh.dfloats;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 8)
    for (int64_t r = 0; r < M; r++) {
        quantize_row(x + r * K, &sh, (int8_t *)rows[r].q, (float *)rows[r].dx,
                     (float *)rows[r].sx);
    }
    int64_t units = (N + OUTS - 1) / OUTS;
    int64_t wrow = K / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        int64_t n0 = u * OUTS, n1 = n0 + OUTS < N ? n0 + OUTS : N;
        for (int64_t r0 = 0; r0 < M; r0 += Q4_ROWS) {
            int64_t nr = M - r0 < Q4_ROWS ? M - r0 : Q4_ROWS;
            vf sums[Q4_ROWS][OUTS];
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *wn = w + n * wrow;
                const uint16_t *dn = d + n * sh.groups, *mn = m + n * sh.groups;
                /* nr past Q4_ROWS never comes: those cases only keep the
                   switch the same for every path's Q4_ROWS */
#define DOT_ROWS(k) \
    case k: dot_rows(wn, dn, mn, &sh, rows + r0, k <= Q4_ROWS ? k : Q4_ROWS, sums, n - n0, out + r0 * N + n0, N); break
                switch (nr) {
                    DOT_ROWS(8);
                    DOT_ROWS(7);
                    DOT_ROWS(6);
                    DOT_ROWS(5);
                    DOT_ROWS(4);
                    DOT_ROWS(3);
                    DOT_ROWS(2);
                default: dot_rows(wn, dn, mn, &sh, rows + r0, 1, sums, n - n0, out + r0 * N + n0, N); break;
                }
#undef DOT_ROWS
            }
            store_sums(sums, nr, n1 - n0, out + r0 * N + n0, N);
        }
    }
    free(rows);
    free(work);
    return 0;
}

/* --- the 8-bit matmul (the vocabulary projection) ---------------------------- */

/* out[M, N] = x[M, K] (bfloat16) @ (q[N, K] int8 * scale[N] bfloat16).T, float32
   (or rounded to bfloat16), K a multiple of 16.

   Each row of x is first written in 16 bits against its largest magnitude
   (x16 = round(x / amax * 32767): within half a step, amax / 65534, of x,
   where bfloat16 itself keeps 8 bits a value), and each output's sum is integer
   work: pairs of 16-bit inputs times pairs of 8-bit weights, summed into one
   int32 lane per output (vpdpwssd on AVX-512, pmaddwd on AVX2), exact; every
   I8_CHUNK inputs the lanes are converted to float32 and added up, and
   ((sum * the float32 nearest 1 / 32767) * the output's scale) * amax is the
   result (in that order: nothing before the last product overflows or is
   subnormal unless the result does or is, even for a row whose 32767 / amax
   would overflow). trioserve.engine.cpu.int8_layout.input_error bounds what
   the 16 bits and the roundings add to the weights' own error.

   The weights' layout (trioserve.engine.cpu.int8_layout.pack_int8): blocks of 16
   outputs (the last padded with zero rows); in a block, for each pair of
   inputs (k, k + 1) in turn, 32 bytes: output j's q[k] and q[k + 1] at bytes
   2j and 2j + 1. So one load and one multiply-add serve 16 outputs and two
   inputs, with the row's two inputs broadcast, and no output is ever summed
   across lanes. A row's arithmetic is the same whatever M is and whichever
   rows share its pass (I8_ROWS), and every path's integers are the same, so
   its bits are too. A row with a value that is not finite gives NaN. */
#define I8_CHUNK 512 /* 256 pairs of at most 2 * 127 * 32767: below 2^31 */

/* Row x's 16-bit integers q and its largest magnitude *amax (NaN where a
   value is not finite). */
static void quantize16(const uint16_t *x, int64_t K, int16_t *q, float *amax_out) {
    for (int64_t i = 0; i < K; i++) {
        if ((x[i] & 0x7f80u) == 0x7f80u) { /* inf or NaN */
            memset(q, 0, (size_t)K * sizeof(int16_t));
            *amax_out = NAN;
            return;
        }
    }
    vf m = vf_zero();
    for (int64_t i = 0; i < K; i += 16) m = vf_max(m, vf_abs(vf_bf16(x + i)));
    float amax = vf_reduce_max(m);
    *amax_out = amax;
    if (amax == 0.0f) {
        memset(q, 0, (size_t)K * sizeof(int16_t));
        return;
    }
    /* x / amax is within [-1, 1] (no reciprocal to overflow on a tiny row) */
    vf va = vf_set1(amax), steps = vf_set1(32767.0f);
    for (int64_t i = 0; i < K; i += 16)
        vi_store_i16(q + i, vi_round(vf_mul(vf_div(vf_bf16(x + i), va), steps)));
}

/* acc[r] = the 16 outputs' sums (before the scales) of row r of x16 (row
   stride K), w a block of 16 outputs; nr is a constant at each call site. */
static inline __attribute__((always_inline)) void int8_block(const int8_t *w, const int16_t *x,
                                                             int64_t K, const int nr, vf *acc) {
    for (int r = 0; r < nr; r++) acc[r] = vf_zero();
    for (int64_t c = 0; c < K; c += I8_CHUNK) {
        int64_t end = c + I8_CHUNK < K ? c + I8_CHUNK : K;
        vi s[I8_ROWS];
        for (int r = 0; r < nr; r++) s[r] = vi_zero();
        for (int64_t k = c; k < end; k += 2) {
            if ((k & 3) == 0) __builtin_prefetch(w + k * 16 + PREFETCH, 0, WEIGHT_PREFETCH_LOCALITY);
            vw wk = vw_load_i8(w + k * 16);
            for (int r = 0; r < nr; r++) s[r] = vi_madd_i16(s[r], wk, x + r * K + k);
        }
        for (int r = 0; r < nr; r++) acc[r] = vf_add(acc[r], vf_from_vi(s[r]));
    }
}

static int int8_matmul(const uint16_t *x, const int8_t *q, const uint16_t *scale, void *out,
                       int out_bf16, int64_t M, int64_t N, int64_t K, int threads) {
    int16_t *xq = aligned_alloc(64, ((size_t)(M * K) * sizeof(int16_t) + 63) / 64 * 64);
    float *amax = malloc((size_t)M * sizeof(float));
    if (!xq || !amax) {
        free(xq);
        free(amax);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 8)
    for (int64_t r = 0; r < M; r++) quantize16(x + r * K, K, xq + r * K, amax + r);
    const vf step = vf_set1(1.0f / 32767.0f);
    int64_t units = (N + OUTS - 1) / OUTS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        int64_t n0 = u * OUTS, count = N - n0 < OUTS ? N - n0 : OUTS;
        const int8_t *wu = q + u * OUTS * K;
        uint16_t sb[OUTS] = {0};
        memcpy(sb, scale + n0, (size_t)count * sizeof(uint16_t));
        vf sc = vf_bf16(sb);
        for (int64_t r0 = 0; r0 < M; r0 += I8_ROWS) {
            int64_t nr = M - r0 < I8_ROWS ? M - r0 : I8_ROWS;
            const int16_t *xr = xq + r0 * K;
            vf acc[I8_ROWS];
            /* nr past I8_ROWS never comes (as in q4_matmul) */
#define I8_BLOCK(k) \
    case k: int8_block(wu, xr, K, k <= I8_ROWS ? k : I8_ROWS, acc); break
            switch (nr) {
                I8_BLOCK(8);
                I8_BLOCK(7);
                I8_BLOCK(6);
                I8_BLOCK(5);
                I8_BLOCK(4);
                I8_BLOCK(3);
                I8_BLOCK(2);
            default: int8_block(wu, xr, K, 1, acc); break;
            }
#undef I8_BLOCK
            for (int64_t r = 0; r < nr; r++) {
                vf v = vf_mul(vf_mul(vf_mul(acc[r], step), sc), vf_set1(amax[r0 + r]));
                int64_t at = (r0 + r) * N + n0;
                uint16_t *o16 = (uint16_t *)out + at;
                float *o32 = (float *)out + at;
                if (count == OUTS) {
                    if (out_bf16) vf_store_bf16(o16, v);
                    else vf_store(o32, v);
                } else { /* the last block's outputs (float_to_bf16: vf_store_bf16's rounding) */
                    float t[OUTS];
                    vf_store(t, v);
                    for (int64_t j = 0; j < count; j++) {
                        if (out_bf16) o16[j] = float_to_bf16(t[j]);
                        else o32[j] = t[j];
                    }
                }
            }
        }
    }
    free(amax);
    free(xq);
    return 0;
}

/* --- the residual add and RMS norm ----------------------------------------- */

/* For each of M rows: x += y (y bfloat16, when given; x float32, in place),
   then out = bfloat16((x * (1 / sqrt(mean(x^2) + eps))) * w), w float32.
   D is a multiple of 16. One row's arithmetic depends on that row alone. */
static void add_norm(float *x, const uint16_t *y, const float *w, uint16_t *out, int64_t M,
                     int64_t D, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 16)
    for (int64_t r = 0; r < M; r++) {
        float *xr = x + r * D;
        vf ss = vf_zero();
        for (int64_t i = 0; i < D; i += 16) {
            vf v = vf_load(xr + i);
            if (y) {
                v = vf_add(v, vf_bf16(y + r * D + i));
                vf_store(xr + i, v);
            }
            ss = vf_fmadd(v, v, ss);
        }
        float inv = 1.0f / sqrtf(vf_reduce_add(ss) / (float)D + eps);
        vf vinv = vf_set1(inv);
        for (int64_t i = 0; i < D; i += 16)
            vf_store_bf16(out + r * D + i, vf_mul(vf_mul(vf_load(xr + i), vinv), vf_load(w + i)));
    }
}

/* --- rope, the KV cache write and attention ------------------------------- */

/* exp of 16 floats (Cephes' expf: range reduction by ln 2 in two parts, a
   degree-5 polynomial, scaling by 2^n), to about 2 ulp; inputs below -87
   give 0, above 88.8 inf (clamped first, so that n stays finite: the other
   paths' scalef agrees with vscalefps for finite n only). The same
   instructions whatever calls it. */
static inline vf exp16(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.3f)), vf_set1(88.8f));
    vf n = vf_floor(vf_fmadd(x, vf_set1(1.44269504088896341f), vf_set1(0.5f)));
    x = vf_fnmadd(n, vf_set1(0.693359375f), x);
    x = vf_fnmadd(n, vf_set1(-2.12194440e-4f), x);
    vf y = vf_set1(1.9875691500e-4f);
    y = vf_fmadd(y, x, vf_set1(1.3981999507e-3f));
    y = vf_fmadd(y, x, vf_set1(8.3334519073e-3f));
    y = vf_fmadd(y, x, vf_set1(4.1665795894e-2f));
    y = vf_fmadd(y, x, vf_set1(1.6666665459e-1f));
    y = vf_fmadd(y, x, vf_set1(5.0000001201e-1f));
    y = vf_fmadd(y, vf_mul(x, x), vf_add(x, vf_set1(1.0f)));
    return vf_scalef(y, n);
}

/* Row r: rope on its query and key heads (float32: x * cos + swapped * sin,
   then bfloat16), keys and values written at its slot and position. */
static void rope_write(const attn_args *a, int64_t r) {
    int64_t H = a->H, K = a->K, E = a->E, half = E / 2;
    const uint16_t *row = a->qkv + r * (H + 2 * K) * E;
    const float *c = a->cos + a->pos[r] * E, *sn = a->sin + a->pos[r] * E;
    uint16_t *base = a->cache + a->slots[r] * 2 * K * a->T * E + a->pos[r] * E;
    for (int64_t h = 0; h < H + K; h++) {
        const uint16_t *x = row + h * E;
        uint16_t *dst = h < H ? a->q + (r * H + h) * E : base + (h - H) * a->T * E;
        for (int64_t i = 0; i < E; i += 16) {
            int64_t j = i < half ? i + half : i - half; /* swapped halves */
            vf v = vf_add(vf_mul(vf_bf16(x + i), vf_load(c + i)), vf_mul(vf_bf16(x + j), vf_load(sn + i)));
            vf_store_bf16(dst + i, v);
        }
    }
    for (int64_t h = 0; h < K; h++)
        memcpy(base + (K + h) * a->T * E, row + (H + K + h) * E, (size_t)E * sizeof(uint16_t));
}

/* Row r, KV head g: its G query heads attend to the slot's positions 0 ..
   pos[r]; `scores` holds G * (pos + 16) floats. */
static void attend(const attn_args *a, int64_t r, int64_t g, float *scores) {
    int64_t H = a->H, K = a->K, E = a->E, G = H / K, p = a->pos[r];
    int64_t n = p + 1, padded = (n + 15) / 16 * 16;
    const uint16_t *keys = a->cache + (a->slots[r] * 2 * K + g) * a->T * E;
    const uint16_t *values = keys + K * a->T * E;
    float totals[MAX_GROUP_HEADS];
    for (int64_t h = 0; h < G; h++) {
        const uint16_t *q = a->q + (r * H + g * G + h) * E;
        float *sc = scores + h * padded;
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            vf part[16];
            for (int jj = 0; jj < 16; jj++) {
                part[jj] = vf_zero();
                if (j0 + jj >= n) continue;
                const uint16_t *k = keys + (j0 + jj) * E;
                for (int64_t i = 0; i < E; i += 32) part[jj] = vf_dpbf16(part[jj], k + i, q + i);
            }
            vf_store(sc + j0, vf_mul(vf_hsum16(part), vf_set1(a->scale)));
        }
        for (int64_t j = n; j < padded; j++) sc[j] = -INFINITY;
        vf mx = vf_set1(-INFINITY);
        for (int64_t j = 0; j < padded; j += 16) mx = vf_max(mx, vf_load(sc + j));
        vf top = vf_set1(vf_reduce_max(mx)), total = vf_zero();
        for (int64_t j = 0; j < padded; j += 16) {
            vf x = vf_load(sc + j);
            /* positions past pos[r] (-inf) weigh exactly 0 */
            vf e = vf_zero_where_neginf(x, exp16(vf_sub(x, top)));
            vf_store(sc + j, e);
            total = vf_add(total, e);
        }
        totals[h] = vf_reduce_add(total);
    }
    /* out = sum_j e_j v_j / sum_j e_j, E / 16 float32 vectors a head, v shared
       by the G heads. */
    for (int64_t i0 = 0; i0 < E; i0 += 64) {
        int64_t width = E - i0 < 64 ? (E - i0) / 16 : 4;
        vf acc[MAX_GROUP_HEADS][4];
        for (int64_t h = 0; h < G; h++)
            for (int w = 0; w < width; w++) acc[h][w] = vf_zero();
        for (int64_t j = 0; j < n; j++) {
            vf v[4];
            for (int w = 0; w < width; w++) v[w] = vf_bf16(values + j * E + i0 + 16 * w);
            for (int64_t h = 0; h < G; h++) {
                vf e = vf_set1(scores[h * padded + j]);
                for (int w = 0; w < width; w++) acc[h][w] = vf_fmadd(e, v[w], acc[h][w]);
            }
        }
        for (int64_t h = 0; h < G; h++) {
            vf inv = vf_set1(1.0f / totals[h]);
            uint16_t *o = a->out + r * H * E + (g * G + h) * E + i0;
            for (int w = 0; w < width; w++) vf_store_bf16(o + 16 * w, vf_mul(acc[h][w], inv));
        }
    }
}

static int attention_all(attn_args *a, int threads) {
    int64_t R = a->R, K = a->K, G = a->H / a->K;
    int64_t longest = 0;
    for (int64_t r = 0; r < R; r++) longest = a->pos[r] > longest ? a->pos[r] : longest;
    uint16_t *q = malloc((size_t)(R * a->H * a->E) * sizeof(uint16_t));
    if (!q) return -1;
    a->q = q;
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= 8)
    for (int64_t r = 0; r < R; r++) rope_write(a, r);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (R * K > 1)
    {
        float *scores = aligned_alloc(64, (size_t)(G * ((longest + 16) / 16 * 16 + 16) + 16) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < R * K; t++)
            if (scores) attend(a, t / K, t % K, scores);
        free(scores);
    }
    free(q);
    return failed ? -1 : 0;
}

/* --- the MLP's gate ---------------------------------------------------------- */

/* out[R, F] = bfloat16(bfloat16(silu(gate)) * up) for gate_up [R, 2F]
   (gate first), silu(x) = x / (1 + exp(-x)) in float32; F a multiple of 16. */
static void silu_mul_rows(const uint16_t *gu, uint16_t *out, int64_t R, int64_t F, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= 8)
    for (int64_t r = 0; r < R; r++) {
        const uint16_t *g = gu + r * 2 * F, *u = g + F;
        for (int64_t i = 0; i < F; i += 16) {
            vf x = vf_bf16(g + i);
            vf sig = vf_div(vf_set1(1.0f), vf_add(vf_set1(1.0f), exp16(vf_sub(vf_zero(), x))));
            uint16_t tmp[16];
            vf_store_bf16(tmp, vf_mul(x, sig));
            vf_store_bf16(out + r * F + i, vf_mul(vf_bf16(tmp), vf_bf16(u + i)));
        }
    }
}

/* --- the layer stack ------------------------------------------------------ */

/* Every layer of one forward pass, on x [R, D] float32 (the residual stream,
   in place), exactly as the per-operator path of trioserve.engine.cpu.llama.forward
   calls these same kernels one by one (so the same bits): for each layer,
   h = norm(x); x += o(attention(qkv(h))); h = norm(x); x += down(silu(gate) * up).
   `table` holds L_FIELDS addresses a layer (kernels.h). */
static int layers(float *x, int64_t R, int64_t D, int64_t H, int64_t K, int64_t E, int64_t F,
                  int64_t n_layers, const int64_t *table, const int64_t *caches, int64_t T,
                  const float *cos, const float *sin, const int64_t *slots, const int64_t *pos,
                  float eps, float scale, int threads) {
    int64_t QKV = (H + 2 * K) * E;
    size_t words = (size_t)R * (size_t)(D + QKV + H * E + D + 2 * F + F + D);
    uint16_t *buf = malloc(words * sizeof(uint16_t));
    if (!buf) return -1;
    uint16_t *h = buf, *qkv = h + R * D, *att = qkv + R * QKV, *o = att + R * H * E;
    uint16_t *gu = o + R * D, *act = gu + R * 2 * F, *down = act + R * F;
    int status = 0;
    const uint16_t *pending = NULL; /* the last layer output not yet added to x */
    /* Stop at the first failure (an allocation), before anything more is
       written to the KV cache or to x. */
#define STEP(call)                  \
    do {                            \
        if ((status = (call)) != 0) \
            goto done;              \
    } while (0)
#define AT(type, field) ((type)t[L_##field])
    for (int64_t l = 0; l < n_layers; l++) {
        const int64_t *t = table + l * L_FIELDS;
        add_norm(x, pending, AT(const float *, attn_norm), h, R, D, eps, threads);
        STEP(q4_matmul(h, AT(const uint8_t *, qkv), AT(const uint16_t *, qkv_d),
                       AT(const uint16_t *, qkv_m), qkv, R, QKV, D, threads));
        attn_args a = {.qkv = qkv, .cos = cos, .sin = sin, .cache = (uint16_t *)caches[l],
                       .slots = slots, .pos = pos, .out = att, .R = R, .H = H, .K = K,
                       .E = E, .T = T, .scale = scale};
        STEP(attention_all(&a, threads));
        STEP(q4_matmul(att, AT(const uint8_t *, o), AT(const uint16_t *, o_d),
                       AT(const uint16_t *, o_m), o, R, D, H * E, threads));
        add_norm(x, o, AT(const float *, mlp_norm), h, R, D, eps, threads);
        STEP(q4_matmul(h, AT(const uint8_t *, gate_up), AT(const uint16_t *, gate_up_d),
                       AT(const uint16_t *, gate_up_m), gu, R, 2 * F, D, threads));
        silu_mul_rows(gu, act, R, F, threads);
        STEP(q4_matmul(act, AT(const uint8_t *, down), AT(const uint16_t *, down_d),
                       AT(const uint16_t *, down_m), down, R, D, F, threads));
        pending = down;
    }
#undef AT
#undef STEP
    if (pending) {
        for (int64_t i = 0; i < R * D; i += 16) vf_store(x + i, vf_add(vf_load(x + i), vf_bf16(pending + i)));
    }
done:
    free(buf);
    return status;
}

const kernel_path KERNEL_PATH = {
    .name = KERNEL_PATH_NAME,
    .q4_matmul = q4_matmul,
    .int8_matmul = int8_matmul,
    .add_norm = add_norm,
    .attention = attention_all,
    .silu_mul = silu_mul_rows,
    .layers = layers,
};
