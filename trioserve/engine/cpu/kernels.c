/* trioserve's native CPU kernels (x86-64, AVX-512 with VNNI and BF16): the
   4-bit matmul, the 8-bit vocabulary projection, the residual add with RMS
   norm, rope with the KV cache write and causal attention, and the MLP's
   silu(gate) * up. Each computes a row from that row alone.

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
   16 vpdpbusd (unsigned 4-bit weights times signed 8-bit inputs, 64
   multiply-adds each) per 512 weights and row, exact in int32 and in the
   float32 it is converted to (below 2^24); what is rounded is in float32, in
   an order that depends on nothing but K:
       sum(w * x) ~ d * (dx / 128) * that + m * (dx / 128) * sum(128 * x8 + r8).
   llama.cpp keeps x8 alone (8 bits); on SmolLM2 that moves near-ties ("What
   is the capital of France?" is then answered "L'Etoile ...", by llama-server
   too): the residual keeps the answers of torch's bfloat16 path there.

   Batch invariance. A row's result is computed by the same instructions,
   in the same order, whatever M is, whichever other rows share its block of
   six and whichever thread computes it: rows are quantized alone, threads
   split the outputs (never K), and a block of fewer rows runs the same
   per-row sequence. So a job's logits do not depend on its companions, nor
   on whether its positions were computed in a prefill chunk or a decode step
   (trioserve.engine.cpu.llama relies on it; tests/test_native.py checks it).

   Built and loaded by trioserve/engine/cpu/native.py (compiled on first use with
   the machine's C compiler, cached on disk). Its functions take raw
   addresses: Python checks shapes, dtypes and contiguity before calling. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define GROUP 32
#define WIDE 16                       /* groups of one wide block: a lane each */
#define WIDE_BYTES 256                /* 16 groups x 16 bytes, as 4 loads of 64 */
#define NARROW 4                      /* groups of one narrow block (the tail) */
#define NARROW_BYTES 64
#define ROWS 6                        /* rows of x sharing one pass over W (of 4, 6 and
                                         8, the fastest at 8 and 64 rows when measured) */
#define OUTS 16                       /* outputs per unit of parallel work */
/* How far ahead of its reads a thread asks for the weights: one core keeps
   too few misses in flight for the memory's bandwidth on its own, and 4 KiB
   ahead was the distance that shortened a decode step's 4-bit matmuls most
   where it was tried. A prefetch past the end of the weights is harmless
   (it never faults). */
#define PREFETCH 4096

/* The weights' layout, per output (trioserve.engine.cpu.native.pack): K / 2
   bytes, a byte holding q[j] of a group in its low nibble and q[j + 16] in
   its high one. The first 16 * (G / 16) groups (G = K / 32) come in wide
   blocks of 16 groups, 256 bytes: 4 loads of 64 bytes, load t holding, for
   each group l of the block in turn, its bytes 4t .. 4t + 3; so that after
   the 8 vpdpbusd of a wide block, lane l of the sum is group l's whole dot
   product, and one conversion and one multiply-add per 16 groups apply the
   scales. The last G % 16 groups follow in narrow blocks of 4 groups, 16
   bytes each, a group after another (the last one may be short).

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

static shape shape_of(int64_t K) {
    shape s;
    s.groups = K / GROUP;
    s.wide = s.groups / WIDE;
    s.narrow = (s.groups % WIDE + NARROW - 1) / NARROW;
    s.qbytes = (size_t)(s.wide * 4 * WIDE_BYTES + s.narrow * 4 * NARROW_BYTES);
    s.dfloats = (size_t)(s.wide * 16 + s.narrow * 16);
    s.sfloats = (size_t)(s.wide * 16 + s.narrow * 4);
    return s;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                          /* nearest even */
    return (uint16_t)(u >> 16);
}

/* 16 bfloat16 values as float32. */
static inline __m512 bf16_16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 float32 values rounded to bfloat16 (nearest even; no NaN expected). */
static inline void store_bf16_16(uint16_t *p, __m512 v) {
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

static void quantize_row(const uint16_t *x, const shape *sh, int8_t *q, float *dx, float *sx) {
    memset(q, 0, sh->qbytes);
    memset(dx, 0, sh->dfloats * sizeof(float));
    memset(sx, 0, sh->sfloats * sizeof(float));
    int8_t *tail_q = q + sh->wide * 4 * WIDE_BYTES;
    float *tail_dx = dx + sh->wide * 16, *tail_sx = sx + sh->wide * 16;
    for (int64_t g = 0; g < sh->groups; g++) {
        const uint16_t *src = x + g * GROUP;
        __m512 a = bf16_16(src), b = bf16_16(src + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax / 127.0f;
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512 va = _mm512_mul_ps(a, _mm512_set1_ps(id)), vb = _mm512_mul_ps(b, _mm512_set1_ps(id));
        __m512i qa = _mm512_cvtps_epi32(va);
        __m512i qb = _mm512_cvtps_epi32(vb);
        __m512 k128 = _mm512_set1_ps(128.0f);
        __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(va, _mm512_cvtepi32_ps(qa)), k128));
        __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(vb, _mm512_cvtepi32_ps(qb)), k128));
        int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(qa, 7), ra), _mm512_add_epi32(_mm512_slli_epi32(qb, 7), rb)));
        d = d / 128.0f;
        int8_t v[GROUP], rv[GROUP];
        _mm_storeu_si128((__m128i *)v, _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(v + 16), _mm512_cvtepi32_epi8(qb));
        _mm_storeu_si128((__m128i *)rv, _mm512_cvtepi32_epi8(ra));
        _mm_storeu_si128((__m128i *)(rv + 16), _mm512_cvtepi32_epi8(rb));
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
                                                           float *res) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < sh->wide; b++) {
        const uint8_t *wb = w + b * WIDE_BYTES;
        for (int t = 0; t < 4; t++) _mm_prefetch((const char *)(wb + PREFETCH + t * 64), _MM_HINT_T0);
        __m512i lo[4], hi[4];
        for (int t = 0; t < 4; t++) {
            __m512i v = _mm512_loadu_si512((const void *)(wb + t * 64));
            lo[t] = _mm512_and_si512(v, low);
            hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * WIDE)));
        __m512 m16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * WIDE)));
        for (int r = 0; r < nr; r++) {
            const int8_t *xq = rows[r].q + b * 4 * WIDE_BYTES;
            __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                s = _mm512_dpbusd_epi32(s, lo[t], _mm512_loadu_si512((const void *)(xq + t * 128)));
                s = _mm512_dpbusd_epi32(s, hi[t],
                                        _mm512_loadu_si512((const void *)(xq + t * 128 + 64)));
                s2 = _mm512_dpbusd_epi32(s2, lo[t], _mm512_loadu_si512((const void *)(xq + 512 + t * 128)));
                s2 = _mm512_dpbusd_epi32(s2, hi[t],
                                        _mm512_loadu_si512((const void *)(xq + 512 + t * 128 + 64)));
            }
            s = _mm512_add_epi32(_mm512_slli_epi32(s, 7), s2);
            __m512 scale = _mm512_mul_ps(d16, _mm512_loadu_ps(rows[r].dx + b * 16));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(rows[r].sx + b * 16), acc[r]);
        }
    }
    const uint8_t *tw = w + sh->wide * WIDE_BYTES;
    const uint16_t *td = d + sh->wide * WIDE, *tm = m + sh->wide * WIDE;
    int64_t left = sh->groups - sh->wide * WIDE;
    for (int64_t b = 0; b < sh->narrow; b++, left -= NARROW) {
        __m512i wb;
        __m128 d4, m4;
        if (left >= NARROW) {
            wb = _mm512_loadu_si512((const void *)(tw + b * NARROW_BYTES));
            d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(td + b * NARROW)));
            m4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(tm + b * NARROW)));
        } else {
            __mmask64 bytes = (1ULL << (left * 16)) - 1;
            __mmask8 halves = (__mmask8)((1u << left) - 1);
            wb = _mm512_maskz_loadu_epi8(bytes, (const void *)(tw + b * NARROW_BYTES));
            d4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(halves, (const void *)(td + b * NARROW)));
            m4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(halves, (const void *)(tm + b * NARROW)));
        }
        __m512i lo = _mm512_and_si512(wb, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wb, 4), low);
        __m512 d16 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d4));
        __m512 m16 = _mm512_zextps128_ps512(m4);
        for (int r = 0; r < nr; r++) {
            const int8_t *xq = rows[r].q + sh->wide * 4 * WIDE_BYTES + b * 4 * NARROW_BYTES;
            const float *dx = rows[r].dx + sh->wide * 16 + b * 16;
            const float *sx = rows[r].sx + sh->wide * 16 + b * 4;
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                            _mm512_loadu_si512((const void *)xq));
            s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512((const void *)(xq + NARROW_BYTES)));
            __m512i s2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)(xq + 128)));
            s2 = _mm512_dpbusd_epi32(s2, hi, _mm512_loadu_si512((const void *)(xq + 128 + NARROW_BYTES)));
            s = _mm512_add_epi32(_mm512_slli_epi32(s, 7), s2);
            __m512 scale = _mm512_mul_ps(d16, _mm512_loadu_ps(dx));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(m16, _mm512_zextps128_ps512(_mm_loadu_ps(sx)), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
}

static int matmul(const uint16_t *x, const uint8_t *w, const uint16_t *d, const uint16_t *m,
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
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            int64_t nr = M - r0 < ROWS ? M - r0 : ROWS;
            for (int64_t n = n0; n < n1; n++) {
                float res[ROWS] = {0};
                const uint8_t *wn = w + n * wrow;
                const uint16_t *dn = d + n * sh.groups, *mn = m + n * sh.groups;
                switch (nr) {
                case 6: dot_rows(wn, dn, mn, &sh, rows + r0, 6, res); break;
                case 5: dot_rows(wn, dn, mn, &sh, rows + r0, 5, res); break;
                case 4: dot_rows(wn, dn, mn, &sh, rows + r0, 4, res); break;
                case 3: dot_rows(wn, dn, mn, &sh, rows + r0, 3, res); break;
                case 2: dot_rows(wn, dn, mn, &sh, rows + r0, 2, res); break;
                default: dot_rows(wn, dn, mn, &sh, rows + r0, 1, res); break;
                }
                for (int64_t r = 0; r < nr; r++) out[(r0 + r) * N + n] = float_to_bf16(res[r]);
            }
        }
    }
    free(rows);
    free(work);
    return 0;
}

/* --- the 8-bit vocabulary projection ------------------------------------- */

/* out[M, N] (bfloat16) = x[M, K] (bfloat16) @ (q[N, K] int8 * scale[N]).T, in
   float32 from the bfloat16 activations as they are (no 8-bit activations:
   trioserve.engine.cpu.llama.logits bounds this projection's error by its
   weights' rounding alone). K is a multiple of 16. A row's sums run in the
   same order whatever M is. */
static int int8_matmul(const uint16_t *x, const int8_t *q, const uint16_t *scale, uint16_t *out,
                       int64_t M, int64_t N, int64_t K, int threads) {
    float *xf = aligned_alloc(64, (size_t)(M * K) * sizeof(float) + 64);
    if (!xf) return -1;
    for (int64_t i = 0; i < M * K; i += 16) _mm512_storeu_ps(xf + i, bf16_16(x + i));
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < (N + OUTS - 1) / OUTS; u++) {
        int64_t n0 = u * OUTS, n1 = n0 + OUTS < N ? n0 + OUTS : N;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            int64_t nr = M - r0 < ROWS ? M - r0 : ROWS;
            for (int64_t n = n0; n < n1; n++) {
                const int8_t *qn = q + n * K;
                __m512 acc[ROWS];
                for (int64_t r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t k = 0; k < K; k += 16) {
                    if ((k & 63) == 0) _mm_prefetch((const char *)(qn + k + PREFETCH), _MM_HINT_T0);
                    __m512 w = _mm512_cvtepi32_ps(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qn + k))));
                    for (int64_t r = 0; r < nr; r++)
                        acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xf + (r0 + r) * K + k), acc[r]);
                }
                uint32_t su = (uint32_t)scale[n] << 16;
                float sf;
                memcpy(&sf, &su, 4);
                for (int64_t r = 0; r < nr; r++)
                    out[(r0 + r) * N + n] = float_to_bf16(_mm512_reduce_add_ps(acc[r]) * sf);
            }
        }
    }
    free(xf);
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
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            if (y) {
                v = _mm512_add_ps(v, bf16_16(y + r * D + i));
                _mm512_storeu_ps(xr + i, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)D + eps);
        __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < D; i += 16)
            store_bf16_16(out + r * D + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), vinv),
                                                         _mm512_loadu_ps(w + i)));
    }
}

/* --- rope, the KV cache write and attention ------------------------------- */

/* exp of 16 floats (Cephes' expf: range reduction by ln 2 in two parts, a
   degree-5 polynomial, scaling by 2^n), to about 2 ulp; inputs below -87
   give 0. The same instructions whatever calls it. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                    _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* The 16 sums of v[0..15] (each 16 lanes), as one vector; lane i holds
   v[i]'s sum (a fixed tree of adds: the same for every call). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* a[i], per 128-bit lane: v[2i] (0+2, 1+3) and v[2i+1] interleaved */
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]))));
    /* b[i], per 128-bit lane L: the lane-L sums of v[4i], v[4i+1], v[4i+2], v[4i+3] */
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                             _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    return d; /* lane i: v[i]'s sum (tests/test_native.py checks the order) */
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
            __m512 v = _mm512_add_ps(_mm512_mul_ps(bf16_16(x + i), _mm512_loadu_ps(c + i)),
                                     _mm512_mul_ps(bf16_16(x + j), _mm512_loadu_ps(sn + i)));
            store_bf16_16(dst + i, v);
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
    float totals[8];
    for (int64_t h = 0; h < G; h++) {
        const uint16_t *q = a->q + (r * H + g * G + h) * E;
        float *sc = scores + h * padded;
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            __m512 part[16];
            for (int jj = 0; jj < 16; jj++) {
                part[jj] = _mm512_setzero_ps();
                if (j0 + jj >= n) continue;
                const uint16_t *k = keys + (j0 + jj) * E;
                for (int64_t i = 0; i < E; i += 32)
                    part[jj] = _mm512_dpbf16_ps(part[jj], (__m512bh)_mm512_loadu_si512((const void *)(k + i)),
                                                (__m512bh)_mm512_loadu_si512((const void *)(q + i)));
            }
            _mm512_storeu_ps(sc + j0, _mm512_mul_ps(hsum16(part), _mm512_set1_ps(a->scale)));
        }
        for (int64_t j = n; j < padded; j++) sc[j] = -INFINITY;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < padded; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + j));
        __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), total = _mm512_setzero_ps();
        for (int64_t j = 0; j < padded; j += 16) {
            __m512 x = _mm512_loadu_ps(sc + j);
            /* positions past pos[r] (-inf) weigh exactly 0 */
            __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                           exp16(_mm512_sub_ps(x, top)));
            _mm512_storeu_ps(sc + j, e);
            total = _mm512_add_ps(total, e);
        }
        totals[h] = _mm512_reduce_add_ps(total);
    }
    /* out = sum_j e_j v_j / sum_j e_j, E / 16 float32 vectors a head, v shared
       by the G heads. */
    for (int64_t i0 = 0; i0 < E; i0 += 64) {
        int64_t width = E - i0 < 64 ? (E - i0) / 16 : 4;
        __m512 acc[8][4];
        for (int64_t h = 0; h < G; h++)
            for (int w = 0; w < width; w++) acc[h][w] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            __m512 v[4];
            for (int w = 0; w < width; w++) v[w] = bf16_16(values + j * E + i0 + 16 * w);
            for (int64_t h = 0; h < G; h++) {
                __m512 e = _mm512_set1_ps(scores[h * padded + j]);
                for (int w = 0; w < width; w++) acc[h][w] = _mm512_fmadd_ps(e, v[w], acc[h][w]);
            }
        }
        for (int64_t h = 0; h < G; h++) {
            __m512 inv = _mm512_set1_ps(1.0f / totals[h]);
            uint16_t *o = a->out + r * H * E + (g * G + h) * E + i0;
            for (int w = 0; w < width; w++) store_bf16_16(o + 16 * w, _mm512_mul_ps(acc[h][w], inv));
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
            __m512 x = bf16_16(g + i);
            __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                       _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            uint16_t tmp[16];
            store_bf16_16(tmp, _mm512_mul_ps(x, sig));
            store_bf16_16(out + r * F + i, _mm512_mul_ps(bf16_16(tmp), bf16_16(u + i)));
        }
    }
}

/* --- the layer stack ------------------------------------------------------ */

/* Per layer, the addresses forward_layers reads (an int64 table the engine
   builds once at load): the two norms' weights, and each 4-bit matmul's
   data, d and m. */
enum { L_ATTN_NORM, L_QKV, L_QKV_D, L_QKV_M, L_O, L_O_D, L_O_M, L_MLP_NORM, L_GU, L_GU_D,
       L_GU_M, L_DOWN, L_DOWN_D, L_DOWN_M, L_FIELDS };

/* Every layer of one forward pass, on x [R, D] float32 (the residual stream,
   in place), exactly as the per-operator path of trioserve.engine.cpu.llama.forward
   calls these same kernels one by one (so the same bits): for each layer,
   h = norm(x); x += o(attention(qkv(h))); h = norm(x); x += down(silu(gate) * up).
   The GIL is released for the whole stack. */
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
    for (int64_t l = 0; l < n_layers; l++) {
        const int64_t *t = table + l * L_FIELDS;
        add_norm(x, pending, (const float *)t[L_ATTN_NORM], h, R, D, eps, threads);
        STEP(matmul(h, (const uint8_t *)t[L_QKV], (const uint16_t *)t[L_QKV_D],
                    (const uint16_t *)t[L_QKV_M], qkv, R, QKV, D, threads));
        attn_args a = {.qkv = qkv, .cos = cos, .sin = sin, .cache = (uint16_t *)caches[l],
                       .slots = slots, .pos = pos, .out = att, .R = R, .H = H, .K = K,
                       .E = E, .T = T, .scale = scale};
        STEP(attention_all(&a, threads));
        STEP(matmul(att, (const uint8_t *)t[L_O], (const uint16_t *)t[L_O_D],
                    (const uint16_t *)t[L_O_M], o, R, D, H * E, threads));
        add_norm(x, o, (const float *)t[L_MLP_NORM], h, R, D, eps, threads);
        STEP(matmul(h, (const uint8_t *)t[L_GU], (const uint16_t *)t[L_GU_D],
                    (const uint16_t *)t[L_GU_M], gu, R, 2 * F, D, threads));
        silu_mul_rows(gu, act, R, F, threads);
        STEP(matmul(act, (const uint8_t *)t[L_DOWN], (const uint16_t *)t[L_DOWN_D],
                    (const uint16_t *)t[L_DOWN_M], down, R, D, F, threads));
        pending = down;
    }
#undef STEP
    if (pending) {
        for (int64_t i = 0; i < R * D; i += 16) {
            __m512 v = _mm512_add_ps(_mm512_loadu_ps(x + i), bf16_16(pending + i));
            _mm512_storeu_ps(x + i, v);
        }
    }
done:
    free(buf);
    return status;
}

/* Reads `pointers` addresses, then numbers. An address may be None (NULL)
   only where bit i of `optional` says so; anything else is a ValueError. */
static int read_args_opt(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int pointers,
                         void **ptr, long long *num, const char *usage, unsigned optional) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (int i = 0; i < pointers; i++) {
        ptr[i] = args[i] == Py_None ? NULL : PyLong_AsVoidPtr(args[i]);
        if (PyErr_Occurred()) return -1;
        if (ptr[i] == NULL && !(optional & (1u << i))) {
            PyErr_SetString(PyExc_ValueError, "a required buffer's address is None or 0");
            return -1;
        }
    }
    for (Py_ssize_t i = pointers; i < want; i++) {
        num[i - pointers] = PyLong_AsLongLong(args[i]);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static int read_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int pointers,
                     void **ptr, long long *num, const char *usage) {
    return read_args_opt(args, nargs, want, pointers, ptr, num, usage, 0);
}

/* A thread count OpenMP can take. */
static int threads_ok(long long threads) {
    if (threads < 1 || threads > 4096) {
        PyErr_SetString(PyExc_ValueError, "threads must be in [1, 4096]");
        return 0;
    }
    return 1;
}

static PyObject *int8_mm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[4];
    long long dims[4];
    if (read_args(args, nargs, 8, 4, ptr, dims, "int8_mm(x, q, scale, out, M, N, K, threads)"))
        return NULL;
    if (dims[0] < 1 || dims[1] < 1 || dims[2] < 16 || dims[2] % 16 || dims[3] < 1) {
        PyErr_SetString(PyExc_ValueError, "int8_mm: M, N >= 1, K a positive multiple of 16");
        return NULL;
    }
    if (!threads_ok(dims[3])) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = int8_matmul((const uint16_t *)ptr[0], (const int8_t *)ptr[1], (const uint16_t *)ptr[2],
                         (uint16_t *)ptr[3], dims[0], dims[1], dims[2], (int)dims[3]);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[7];
    long long num[8];
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError,
                        "attention(qkv, cos, sin, cache, slots, pos, out, R, H, K, E, T, S, "
                        "rope_length, scale, threads)");
        return NULL;
    }
    if (read_args(args, 14, 14, 7, ptr, num, "")) return NULL;
    double scale = PyFloat_AsDouble(args[14]);
    long long threads = PyLong_AsLongLong(args[15]);
    if (PyErr_Occurred()) return NULL;
    attn_args a = {.qkv = ptr[0], .cos = ptr[1], .sin = ptr[2], .cache = ptr[3], .slots = ptr[4],
                   .pos = ptr[5], .out = ptr[6], .R = num[0], .H = num[1], .K = num[2],
                   .E = num[3], .T = num[4], .scale = (float)scale};
    long long S = num[5], rope_length = num[6];
    if (!threads_ok(threads)) return NULL;
    if (a.R < 1 || a.K < 1 || a.H < 1 || a.H % a.K || a.H / a.K > 8 || a.E < 32 || a.E % 32) {
        PyErr_SetString(PyExc_ValueError, "attention: R >= 1, H a multiple of K (at most 8x), E a multiple of 32");
        return NULL;
    }
    for (int64_t r = 0; r < a.R; r++) {
        if (a.slots[r] < 0 || a.slots[r] >= S || a.pos[r] < 0 || a.pos[r] >= a.T || a.pos[r] >= rope_length) {
            PyErr_SetString(PyExc_ValueError, "attention: a row's slot or position is outside the cache");
            return NULL;
        }
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = attention_all(&a, (int)threads);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[2];
    long long num[3];
    if (read_args(args, nargs, 5, 2, ptr, num, "silu_mul(gate_up, out, R, F, threads)")) return NULL;
    if (num[0] < 1 || num[1] < 16 || num[1] % 16 || !threads_ok(num[2])) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "silu_mul: R >= 1, F a positive multiple of 16");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_rows((const uint16_t *)ptr[0], (uint16_t *)ptr[1], num[0], num[1], (int)num[2]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *forward_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[7];
    long long num[11];
    if (nargs != 20) {
        PyErr_SetString(PyExc_TypeError,
                        "forward_layers(x, table, caches, cos, sin, slots, pos, R, D, H, K, E, F, "
                        "n_layers, T, S, rope_length, threads, eps, scale)");
        return NULL;
    }
    if (read_args(args, 18, 18, 7, ptr, num, "")) return NULL;
    double eps = PyFloat_AsDouble(args[18]), scale = PyFloat_AsDouble(args[19]);
    if (PyErr_Occurred()) return NULL;
    long long R = num[0], D = num[1], H = num[2], K = num[3], E = num[4], F = num[5];
    long long n_layers = num[6], T = num[7], S = num[8], rope_length = num[9], threads = num[10];
    const int64_t *slots = ptr[5], *pos = ptr[6];
    if (!threads_ok(threads)) return NULL;
    if (R < 1 || D < 32 || D % 32 || K < 1 || H < 1 || H % K || H / K > 8 || E < 32 || E % 32 ||
        (H * E) % 32 || F < 32 || F % 32 || n_layers < 1) {
        PyErr_SetString(PyExc_ValueError, "forward_layers: shapes the kernels cannot run");
        return NULL;
    }
    for (int64_t r = 0; r < R; r++) {
        if (slots[r] < 0 || slots[r] >= S || pos[r] < 0 || pos[r] >= T || pos[r] >= rope_length) {
            PyErr_SetString(PyExc_ValueError, "forward_layers: a row's slot or position is outside the cache");
            return NULL;
        }
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = layers((float *)ptr[0], R, D, H, K, E, F, n_layers, (const int64_t *)ptr[1],
                    (const int64_t *)ptr[2], T, (const float *)ptr[3], (const float *)ptr[4], slots,
                    pos, (float)eps, (float)scale, (int)threads);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "add_rms_norm(x, y or None, w, out, M, D, eps, threads)");
        return NULL;
    }
    void *ptr[4];
    long long dims[2];
    if (read_args_opt(args, 6, 6, 4, ptr, dims, "", 1u << 1)) return NULL;
    double eps = PyFloat_AsDouble(args[6]);
    long long threads = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (dims[0] < 1 || dims[1] < 16 || dims[1] % 16 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "add_rms_norm: M >= 1, D a positive multiple of 16");
        return NULL;
    }
    if (!threads_ok(threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    add_norm((float *)ptr[0], (const uint16_t *)ptr[1], (const float *)ptr[2], (uint16_t *)ptr[3],
             dims[0], dims[1], (float)eps, (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *q4_mm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[5];
    long long dims[4];
    if (read_args(args, nargs, 9, 5, ptr, dims, "q4_mm(x, w, d, m, out, M, N, K, threads)"))
        return NULL;
    if (dims[0] < 1 || dims[1] < 1 || dims[2] < GROUP || dims[2] % GROUP || dims[3] < 1) {
        PyErr_SetString(PyExc_ValueError, "q4_mm: M, N >= 1, K a positive multiple of 32");
        return NULL;
    }
    if (!threads_ok(dims[3])) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = matmul((const uint16_t *)ptr[0], (const uint8_t *)ptr[1], (const uint16_t *)ptr[2],
                    (const uint16_t *)ptr[3], (uint16_t *)ptr[4], dims[0], dims[1], dims[2],
                    (int)dims[3]);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int cpu_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

static PyObject *supported(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(cpu_ok());
}

static PyMethodDef methods[] = {
    {"q4_mm", (PyCFunction)(void (*)(void))q4_mm, METH_FASTCALL,
     "q4_mm(x, w, d, m, out, M, N, K, threads): out = x @ W.T (addresses of contiguous buffers)"},
    {"int8_mm", (PyCFunction)(void (*)(void))int8_mm, METH_FASTCALL,
     "int8_mm(x, q, scale, out, M, N, K, threads): out = x @ (q * scale).T"},
    {"add_rms_norm", (PyCFunction)(void (*)(void))add_rms_norm, METH_FASTCALL,
     "add_rms_norm(x, y, w, out, M, D, eps, threads): x += y; out = rms_norm(x) * w"},
    {"attention", (PyCFunction)(void (*)(void))attention, METH_FASTCALL,
     "attention(...): rope, the KV cache write and causal attention of a forward pass's rows"},
    {"silu_mul", (PyCFunction)(void (*)(void))silu_mul, METH_FASTCALL,
     "silu_mul(gate_up, out, R, F, threads): out = silu(gate) * up"},
    {"forward_layers", (PyCFunction)(void (*)(void))forward_layers, METH_FASTCALL,
     "forward_layers(...): every layer of a forward pass on the residual stream, in place"},
    {"supported", supported, METH_NOARGS, "whether this CPU runs the kernel"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_trioserve_cpu", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__trioserve_cpu(void) { return PyModule_Create(&module); }
