/* The 16-lane vector interface of kernels_arith.h on AVX-512 (F, BW, VL,
   VNNI, BF16): one register per vector. kernels_vec_avx2.h computes each
   operation with AVX2 in the same order, lane for lane. */

#include <immintrin.h>

typedef __m512 vf;  /* 16 float32 */
typedef __m512i vi; /* 16 int32 */
typedef __m512i vb; /* 64 bytes (4-bit weights) */

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float f) { return _mm512_set1_ps(f); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
/* a > b ? a : b (b where either is NaN), as maxps. */
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
/* a < b ? a : b (b where either is NaN), as minps. */
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
/* a * b + c and c - a * b, each rounded once. */
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vf_floor(vf a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
/* y * 2^floor(n), rounded once. */
static inline vf vf_scalef(vf y, vf n) { return _mm512_scalef_ps(y, n); }
static inline vf vf_from_vi(vi a) { return _mm512_cvtepi32_ps(a); }
/* e where x is not -inf, else +0. */
static inline vf vf_zero_where_neginf(vf x, vf e) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
}

/* The sum of the 16 lanes in a fixed order: upper half + lower half, then
   the same on 4 lanes, then lanes (0 + 2) + (1 + 3). */
static inline float vf_reduce_add(vf v) {
    __m256 t = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 0)));
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_extractf128_ps(t, 0));
    s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 1, 1, 1))));
}

/* Lane j = vf_reduce_add(v[j]), bit for bit, for 16 vectors at once: the
   same additions in the same tree (the 256-bit halves, the 128-bit quarters,
   lanes 0 + 2 and 1 + 3, then 0 + 1), done across vectors by shuffles
   (about 3 instructions a sum, not 9), then put in order. */
static inline vf vf_reduce_add16(const vf *v) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++) /* [v[2i] hi + lo | v[2i+1] hi + lo] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44));
    for (int i = 0; i < 4; i++) /* quarter q: v[4i + q]'s 128-bit halves added */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88));
#define PD(x) _mm512_castps_pd(x)
    for (int i = 0; i < 2; i++) /* quarter q: lanes 0 + 2, 1 + 3 of v[8i + q], v[8i + 4 + q] */
        e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(PD(d[2 * i]), PD(d[2 * i + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(PD(d[2 * i]), PD(d[2 * i + 1]))));
#undef PD
    /* lane 4q + k: v[4k + q]'s sum */
    __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, f);
}

/* The largest lane, in the same order as vf_reduce_add. */
static inline float vf_reduce_max(vf v) {
    __m256 t = _mm256_max_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 0)));
    __m128 s = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_extractf128_ps(t, 0));
    s = _mm_max_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 1, 1, 1))));
}

/* 16 bfloat16, float16 or int8 values as float32 (exact). */
static inline vf vf_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* For a narrow block of n <= 4 groups: each of the n float16 values at p
   as float32 in 4 lanes (lane l: p[l / 4]), or in lanes 0 .. n - 1 alone;
   and the 4 floats at p in lanes 0-3. Zero elsewhere. */
static inline __m128 f16_first4(const uint16_t *p, int n) {
    if (n >= 4) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
    return _mm_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << n) - 1), (const void *)p));
}
static inline vf vf_f16_spread4(const uint16_t *p, int n) {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(f16_first4(p, n)));
}
static inline vf vf_f16_first4(const uint16_t *p, int n) {
    return _mm512_zextps128_ps512(f16_first4(p, n));
}
static inline vf vf_load_first4(const float *p) { return _mm512_zextps128_ps512(_mm_loadu_ps(p)); }

/* 16 float32 rounded to bfloat16 as float_to_bf16 does (NaN included). */
static inline void vf_store_bf16(uint16_t *p, vf v) {
    const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))),
        16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(BF16_NAN));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

/* acc + the bfloat16 products of k and q (32 each), lane i taking elements
   2i + 1 and then 2i, each product exact and each addition rounded
   (vdpbf16ps; which flushes subnormal inputs and results to zero, where the
   AVX2 path keeps them: the one place the paths can differ, with values
   below 1.2e-38). */
static inline vf vf_dpbf16(vf acc, const uint16_t *k, const uint16_t *q) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)k),
                            (__m512bh)_mm512_loadu_si512((const void *)q));
}

/* The 16 sums of v[0..15] (each 16 lanes), as one vector; lane i holds
   v[i]'s sum (a fixed tree of adds: the same for every call). */
static inline vf vf_hsum16(const vf *v) {
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
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
/* Nearest, ties to even (the default rounding mode), as cvtps2dq. */
static inline vi vi_round(vf a) { return _mm512_cvtps_epi32(a); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_shl7(vi a) { return _mm512_slli_epi32(a, 7); }
static inline int32_t vi_reduce_add(vi a) { return _mm512_reduce_add_epi32(a); }
/* The low byte of each lane (the values fit in int8). */
static inline void vi_store_i8(int8_t *p, vi a) {
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a));
}
/* The low 16 bits of each lane (the values fit in int16). */
static inline void vi_store_i16(int16_t *p, vi a) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(a));
}

/* The 8-bit matmul's weights (kernels_arith.h): 16 lanes of two int16, lane l
   bytes 2l and 2l + 1 of 32. */
typedef __m512i vw;
static inline vw vw_load_i8(const int8_t *p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}
/* acc + lane l's two weights times x[0], x[1] (int16), exact in int32. */
static inline vi vi_madd_i16(vi acc, vw w, const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, 4);
    return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(pair));
}

static inline vb vb_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
/* The first n bytes at p, the rest zero. */
static inline vb vb_load_first(const uint8_t *p, int n) {
    if (n >= 64) return _mm512_loadu_si512((const void *)p);
    return _mm512_maskz_loadu_epi8((1ULL << n) - 1, (const void *)p);
}
static inline vb vb_low(vb v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline vb vb_high(vb v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
}

/* Lane l: sum over the 4 bytes 4l .. 4l + 3 of w (unsigned, < 16) times those
   of x (signed), over n pairs (w[i], x + step * i ...): exact in int32. A wide
   block is 8 such pairs, a narrow one 2. */
static inline vi vi_dot(const vb *w, const int8_t *const *x, const int n) {
    vi s = _mm512_setzero_si512();
    for (int i = 0; i < n; i++)
        s = _mm512_dpbusd_epi32(s, w[i], _mm512_loadu_si512((const void *)x[i]));
    return s;
}
