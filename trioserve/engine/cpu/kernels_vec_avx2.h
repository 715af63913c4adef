/* The 16-lane vector interface of kernels_arith.h on AVX2 with FMA and F16C:
   a vector is two 8-lane registers (lanes 0-7, 8-15), and each operation is
   kernels_vec_avx512.h's, computed in the same order lane for lane, so that
   the two paths give the same bits (the reductions and the sum tree follow
   the AVX-512 registers' halves and 128-bit quarters). */

#include <immintrin.h>

typedef struct {
    __m256 lo, hi;
} vf;
typedef struct {
    __m256i lo, hi;
} vi;
typedef struct {
    __m256i lo, hi;
} vb;

#define VF2(expr_lo, expr_hi) ((vf){.lo = (expr_lo), .hi = (expr_hi)})
#define VI2(expr_lo, expr_hi) ((vi){.lo = (expr_lo), .hi = (expr_hi)})

static inline vf vf_zero(void) { return VF2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float f) { return VF2(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline vf vf_load(const float *p) { return VF2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline vf vf_add(vf a, vf b) { return VF2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vf vf_sub(vf a, vf b) { return VF2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vf vf_mul(vf a, vf b) { return VF2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vf vf_div(vf a, vf b) { return VF2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline vf vf_max(vf a, vf b) { return VF2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline vf vf_min(vf a, vf b) { return VF2(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
static inline vf vf_abs(vf a) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return VF2(_mm256_and_ps(a.lo, mask), _mm256_and_ps(a.hi, mask));
}
static inline vf vf_fmadd(vf a, vf b, vf c) {
    return VF2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_fnmadd(vf a, vf b, vf c) {
    return VF2(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_floor(vf a) { return VF2(_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)); }

/* y * 2^n for n an integral float (vf_floor's), rounded once, as vscalefps:
   n clamped to [-126, 254] (y is in [0.5, 2] where it is called, so the
   clamp changes no finite result) and split in two powers of two that are
   normal floats; y * 2^n1 is exact, and the second product rounds once. */
static inline __m256 scalef8(__m256 y, __m256 n) {
    n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(254.0f));
    __m256i k = _mm256_cvtps_epi32(n);
    __m256i k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}
static inline vf vf_scalef(vf y, vf n) { return VF2(scalef8(y.lo, n.lo), scalef8(y.hi, n.hi)); }
static inline vf vf_from_vi(vi a) { return VF2(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
static inline vf vf_zero_where_neginf(vf x, vf e) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    return VF2(_mm256_and_ps(_mm256_cmp_ps(x.lo, ninf, _CMP_NEQ_OQ), e.lo),
               _mm256_and_ps(_mm256_cmp_ps(x.hi, ninf, _CMP_NEQ_OQ), e.hi));
}

static inline float vf_reduce_add(vf v) {
    __m256 t = _mm256_add_ps(v.hi, v.lo);
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_extractf128_ps(t, 0));
    s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 1, 1, 1))));
}

/* Lane j = vf_reduce_add(v[j]), bit for bit, for 16 vectors at once: the
   same additions in the same tree (hi + lo, the 128-bit halves, lanes 0 + 2
   and 1 + 3, then 0 + 1), done across vectors by shuffles (about 4
   instructions a sum, not 9), then put in order. */
static inline vf vf_reduce_add16(const vf *v) {
    __m256 t[16], d[8], e[4], f[2];
    for (int i = 0; i < 16; i++) t[i] = _mm256_add_ps(v[i].hi, v[i].lo);
    for (int i = 0; i < 8; i++) /* [t[2i]'s halves added | t[2i+1]'s] */
        d[i] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x31),
                             _mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x20));
#define PD(x) _mm256_castps_pd(x)
    for (int i = 0; i < 4; i++) /* half h: lanes 0 + 2, 1 + 3 of v[4i + h], v[4i + 2 + h] */
        e[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(PD(d[2 * i]), PD(d[2 * i + 1]))),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(PD(d[2 * i]), PD(d[2 * i + 1]))));
#undef PD
    /* f[i], lane 4h + k: v[8i + 2k + h]'s sum */
    for (int i = 0; i < 2; i++)
        f[i] = _mm256_add_ps(_mm256_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256i order = _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0);
    return VF2(_mm256_permutevar8x32_ps(f[0], order), _mm256_permutevar8x32_ps(f[1], order));
}

static inline float vf_reduce_max(vf v) {
    __m256 t = _mm256_max_ps(v.hi, v.lo);
    __m128 s = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_extractf128_ps(t, 0));
    s = _mm_max_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 1, 1, 1))));
}

static inline __m256 bf16_8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_bf16(const uint16_t *p) { return VF2(bf16_8(p), bf16_8(p + 8)); }
static inline vf vf_f16(const uint16_t *p) {
    return VF2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
               _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
/* kernels_vec_avx512.h's narrow-block loads. */
static inline __m128 f16_first(const uint16_t *p, int n) {
    if (n >= 4) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
    uint64_t t = 0;
    memcpy(&t, p, (size_t)n * sizeof(uint16_t));
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)t));
}
static inline vf vf_f16_spread4(const uint16_t *p, int n) {
    __m256 d4 = _mm256_castps128_ps256(f16_first(p, n));
    return VF2(_mm256_permutevar8x32_ps(d4, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0)),
               _mm256_permutevar8x32_ps(d4, _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2)));
}
static inline vf vf_f16_first4(const uint16_t *p, int n) {
    return VF2(_mm256_zextps128_ps256(f16_first(p, n)), _mm256_setzero_ps());
}
static inline vf vf_load_first4(const float *p) {
    return VF2(_mm256_zextps128_ps256(_mm_loadu_ps(p)), _mm256_setzero_ps());
}

static inline __m256i bf16_round8(__m256 v) {
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))),
        16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(BF16_NAN), nan);
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
    /* packus works per 128-bit half: [lo 0-3, hi 0-3, lo 4-7, hi 4-7], then
       the quarters in order (every value fits in 16 bits: no saturation). */
    __m256i packed = _mm256_packus_epi32(bf16_round8(v.lo), bf16_round8(v.hi));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* vdpbf16ps's order on 8 lanes: acc + k[2i+1] q[2i+1], then + k[2i] q[2i]
   (the products of two bfloat16 are exact in float32). */
static inline __m256 dpbf16_8(__m256 acc, const uint16_t *k, const uint16_t *q) {
    __m256i kv = _mm256_loadu_si256((const __m256i *)k), qv = _mm256_loadu_si256((const __m256i *)q);
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 k_odd = _mm256_castsi256_ps(_mm256_and_si256(kv, high));
    __m256 q_odd = _mm256_castsi256_ps(_mm256_and_si256(qv, high));
    __m256 k_even = _mm256_castsi256_ps(_mm256_slli_epi32(kv, 16));
    __m256 q_even = _mm256_castsi256_ps(_mm256_slli_epi32(qv, 16));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(k_odd, q_odd));
    return _mm256_add_ps(acc, _mm256_mul_ps(k_even, q_even));
}
static inline vf vf_dpbf16(vf acc, const uint16_t *k, const uint16_t *q) {
    return VF2(dpbf16_8(acc.lo, k, q), dpbf16_8(acc.hi, k + 16, q + 16));
}

/* kernels_vec_avx512.h's tree: its 128-bit quarters 0 and 1 are .lo's
   halves, 2 and 3 .hi's; shuffle_f32x4's picks are permute2f128's. */
static inline vf vf_hsum16(const vf *v) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        a[i].lo = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].lo, v[2 * i + 1].lo),
                                _mm256_unpackhi_ps(v[2 * i].lo, v[2 * i + 1].lo));
        a[i].hi = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].hi, v[2 * i + 1].hi),
                                _mm256_unpackhi_ps(v[2 * i].hi, v[2 * i + 1].hi));
    }
#define PAIRS(x, y)                                                                             \
    _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))), \
                  _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))))
    for (int i = 0; i < 4; i++) {
        b[i].lo = PAIRS(a[2 * i].lo, a[2 * i + 1].lo);
        b[i].hi = PAIRS(a[2 * i].hi, a[2 * i + 1].hi);
    }
#undef PAIRS
    /* [x quarter 0 + quarter 1, x quarter 2 + quarter 3] of one vector x */
#define QUARTERS(x) \
    _mm256_add_ps(_mm256_permute2f128_ps((x).lo, (x).hi, 0x20), _mm256_permute2f128_ps((x).lo, (x).hi, 0x31))
    for (int i = 0; i < 2; i++) {
        c[i].lo = QUARTERS(b[2 * i]);
        c[i].hi = QUARTERS(b[2 * i + 1]);
    }
    vf d = {.lo = QUARTERS(c[0]), .hi = QUARTERS(c[1])};
#undef QUARTERS
    return d;
}

static inline vi vi_zero(void) { return VI2(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline vi vi_round(vf a) { return VI2(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)); }
static inline vi vi_add(vi a, vi b) {
    return VI2(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi));
}
static inline vi vi_shl7(vi a) { return VI2(_mm256_slli_epi32(a.lo, 7), _mm256_slli_epi32(a.hi, 7)); }
static inline int32_t vi_reduce_add(vi a) {
    __m256i t = _mm256_add_epi32(a.lo, a.hi);
    __m128i s = _mm_add_epi32(_mm256_extracti128_si256(t, 1), _mm256_castsi256_si128(t));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}
static inline void vi_store_i8(int8_t *p, vi a) {
    int32_t t[16];
    _mm256_storeu_si256((__m256i *)t, a.lo);
    _mm256_storeu_si256((__m256i *)(t + 8), a.hi);
    for (int i = 0; i < 16; i++) p[i] = (int8_t)t[i];
}
static inline void vi_store_i16(int16_t *p, vi a) {
    int32_t t[16];
    _mm256_storeu_si256((__m256i *)t, a.lo);
    _mm256_storeu_si256((__m256i *)(t + 8), a.hi);
    for (int i = 0; i < 16; i++) p[i] = (int16_t)t[i];
}

/* The 8-bit matmul's weights (kernels_arith.h): 16 lanes of two int16, lane l
   bytes 2l and 2l + 1 of 32. */
typedef struct {
    __m256i lo, hi;
} vw;
static inline vw vw_load_i8(const int8_t *p) {
    return (vw){.lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
                .hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
/* acc + lane l's two weights times x[0], x[1] (int16), exact in int32:
   AVX-VNNI's vpdpwssd, or madd and an add (the same integers). */
static inline vi vi_madd_i16(vi acc, vw w, const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, 4);
    __m256i b = _mm256_set1_epi32(pair);
#if defined(KERNELS_AVX2_VNNI)
    return VI2(_mm256_dpwssd_avx_epi32(acc.lo, w.lo, b), _mm256_dpwssd_avx_epi32(acc.hi, w.hi, b));
#else
    return VI2(_mm256_add_epi32(acc.lo, _mm256_madd_epi16(w.lo, b)),
               _mm256_add_epi32(acc.hi, _mm256_madd_epi16(w.hi, b)));
#endif
}

static inline vb vb_load(const uint8_t *p) {
    return (vb){.lo = _mm256_loadu_si256((const __m256i *)p),
                .hi = _mm256_loadu_si256((const __m256i *)(p + 32))};
}
/* n is a multiple of 4 (whole groups of 16 bytes): maskload's dwords. */
static inline vb vb_load_first(const uint8_t *p, int n) {
    if (n >= 64) return vb_load(p);
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(n / 4), lane);
    __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(n / 4 - 8), lane);
    return (vb){.lo = _mm256_maskload_epi32((const int *)p, lo),
                .hi = _mm256_maskload_epi32((const int *)(p + 32), hi)};
}
static inline vb vb_low(vb v) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    return (vb){.lo = _mm256_and_si256(v.lo, low), .hi = _mm256_and_si256(v.hi, low)};
}
static inline vb vb_high(vb v) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    return (vb){.lo = _mm256_and_si256(_mm256_srli_epi16(v.lo, 4), low),
                .hi = _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), low)};
}

/* u8 x s8 products summed four at a time into int32, as vpdpbusd does:
   with AVX-VNNI (KERNELS_AVX2_VNNI: Intel since Alder Lake and Sapphire
   Rapids, AMD since Zen 5) the VEX-encoded instruction itself; without it
   maddubs gives each pair of bytes' products summed in int16 (at most
   2 * 15 * 127 = 3810 in magnitude), the n <= 8 pairs' int16 sums stay below
   2^15 (30480), and one madd by ones adds each lane's two halves into int32.
   Either way the same integers. */
#if defined(KERNELS_AVX2_VNNI)
#define DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
static inline vi vi_dot(const vb *w, const int8_t *const *x, const int n) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int i = 0; i < n; i++) {
        lo = DPBUSD(lo, w[i].lo, _mm256_loadu_si256((const __m256i *)x[i]));
        hi = DPBUSD(hi, w[i].hi, _mm256_loadu_si256((const __m256i *)(x[i] + 32)));
    }
    return VI2(lo, hi);
}
#else
static inline vi vi_dot(const vb *w, const int8_t *const *x, const int n) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int i = 0; i < n; i++) {
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[i].lo, _mm256_loadu_si256((const __m256i *)x[i])));
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[i].hi, _mm256_loadu_si256((const __m256i *)(x[i] + 32))));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    return VI2(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
}
#endif

/* A wide block's dot products with nr rows (kernels_arith.h's wide_dots).
   AVX2 has 16 registers, too few to hold a block's unpacked weights (both
   nibbles of 256 bytes: 16) beside the sums, but enough for one 256-bit
   half's (8): so each half's weights are loaded and unpacked once and serve
   every row (the unpack, 3 instructions a load, is then not paid per row),
   and each row sums its 8-bit and residual parts apart in int16 (each below
   30,480: see vi_dot), then 128 * the first + the second in int32: the same
   integers as kernels_vec_avx512.h's. */
#define KERNELS_OWN_WIDE_DOT 1
static inline __attribute__((always_inline)) void wide_dots(const uint8_t *wb,
                                                            const int8_t *const *xq,
                                                            const int nr, vi *s) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        __m256i w[8];
        for (int t = 0; t < 4; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wb + h * 32 + t * 64));
            w[2 * t] = _mm256_and_si256(v, low);
            w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
#pragma GCC unroll 1
        for (int r = 0; r < nr; r++) {
            const int8_t *x = xq[r] + h * 32;
            __m256i x8 = _mm256_setzero_si256(), r8 = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                const int8_t *xt = x + t * 128;
#if defined(KERNELS_AVX2_VNNI)
                x8 = DPBUSD(x8, w[2 * t], _mm256_loadu_si256((const __m256i *)xt));
                x8 = DPBUSD(x8, w[2 * t + 1], _mm256_loadu_si256((const __m256i *)(xt + 64)));
                r8 = DPBUSD(r8, w[2 * t], _mm256_loadu_si256((const __m256i *)(xt + 512)));
                r8 = DPBUSD(r8, w[2 * t + 1], _mm256_loadu_si256((const __m256i *)(xt + 576)));
#else
                x8 = _mm256_add_epi16(x8, _mm256_maddubs_epi16(w[2 * t], _mm256_loadu_si256((const __m256i *)xt)));
                x8 = _mm256_add_epi16(x8, _mm256_maddubs_epi16(w[2 * t + 1], _mm256_loadu_si256((const __m256i *)(xt + 64))));
                r8 = _mm256_add_epi16(r8, _mm256_maddubs_epi16(w[2 * t], _mm256_loadu_si256((const __m256i *)(xt + 512))));
                r8 = _mm256_add_epi16(r8, _mm256_maddubs_epi16(w[2 * t + 1], _mm256_loadu_si256((const __m256i *)(xt + 576))));
#endif
                __asm__("" : "+x"(x8), "+x"(r8));
            }
#if defined(KERNELS_AVX2_VNNI)
            __m256i v = _mm256_add_epi32(_mm256_slli_epi32(x8, 7), r8);
#else
            __m256i v = _mm256_add_epi32(_mm256_madd_epi16(x8, _mm256_set1_epi16(128)),
                                         _mm256_madd_epi16(r8, _mm256_set1_epi16(1)));
#endif
            if (h == 0)
                s[r].lo = v;
            else
                s[r].hi = v;
        }
    }
}

/* A narrow block's dot products with nr rows (kernels_arith.h's
   narrow_dots), per 256-bit half: lanes 0-7 are groups 0 and 1, 8-15 groups
   2 and 3, so where at most 2 groups are there (K = 576: 18 groups, 2 past
   the wide block) the upper half is zero and not computed. */
static inline __m256i narrow_half(__m256i v, const int8_t *x) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#if defined(KERNELS_AVX2_VNNI)
    const __m256i zero = _mm256_setzero_si256();
    __m256i x8 = DPBUSD(DPBUSD(zero, lo, _mm256_loadu_si256((const __m256i *)x)), hi,
                        _mm256_loadu_si256((const __m256i *)(x + 64)));
    __m256i r8 = DPBUSD(DPBUSD(zero, lo, _mm256_loadu_si256((const __m256i *)(x + 128))), hi,
                        _mm256_loadu_si256((const __m256i *)(x + 192)));
    return _mm256_add_epi32(_mm256_slli_epi32(x8, 7), r8);
#else
    __m256i x8 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                                  _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 64))));
    __m256i r8 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x + 128))),
                                  _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 192))));
    return _mm256_add_epi32(_mm256_madd_epi16(x8, _mm256_set1_epi16(128)),
                            _mm256_madd_epi16(r8, _mm256_set1_epi16(1)));
#endif
}
#define KERNELS_OWN_NARROW_DOT 1
static inline __attribute__((always_inline)) void narrow_dots(const uint8_t *wb, int present,
                                                              const int8_t *const *xq,
                                                              const int nr, vi *s) {
    vb v = vb_load_first(wb, present * 16);
    if (present > 2) {
        for (int r = 0; r < nr; r++) s[r] = VI2(narrow_half(v.lo, xq[r]), narrow_half(v.hi, xq[r] + 32));
    } else {
        for (int r = 0; r < nr; r++) s[r] = VI2(narrow_half(v.lo, xq[r]), _mm256_setzero_si256());
    }
}
