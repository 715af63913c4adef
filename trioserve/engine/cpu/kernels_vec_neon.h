/* The 16-lane vector interface of kernels_arith.h on ARM64 (NEON, with the
   dot-product instructions where KERNELS_DOTPROD is defined): a vector is
   four 4-lane registers, and each operation is kernels_vec_avx512.h's,
   computed in the same order lane for lane, x86's semantics included where
   ARM's differ (maxps's "a > b ? a : b", cmpneq_oq's NaN), so that the
   paths give the same bits. */

#include <arm_neon.h>

typedef struct {
    float32x4_t v[4];
} vf;
typedef struct {
    int32x4_t v[4];
} vi;
typedef struct {
    uint8x16_t v[4];
} vb;

#define EACH(out, expr)                   \
    do {                                  \
        for (int q_ = 0; q_ < 4; q_++) {  \
            const int i = q_;             \
            (out).v[i] = (expr);          \
        }                                 \
    } while (0)

static inline vf vf_zero(void) {
    vf r;
    EACH(r, vdupq_n_f32(0.0f));
    return r;
}
static inline vf vf_set1(float f) {
    vf r;
    EACH(r, vdupq_n_f32(f));
    return r;
}
static inline vf vf_load(const float *p) {
    vf r;
    EACH(r, vld1q_f32(p + 4 * i));
    return r;
}
static inline void vf_store(float *p, vf v) {
    for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.v[i]);
}
static inline vf vf_add(vf a, vf b) {
    vf r;
    EACH(r, vaddq_f32(a.v[i], b.v[i]));
    return r;
}
static inline vf vf_sub(vf a, vf b) {
    vf r;
    EACH(r, vsubq_f32(a.v[i], b.v[i]));
    return r;
}
static inline vf vf_mul(vf a, vf b) {
    vf r;
    EACH(r, vmulq_f32(a.v[i], b.v[i]));
    return r;
}
static inline vf vf_div(vf a, vf b) {
    vf r;
    EACH(r, vdivq_f32(a.v[i], b.v[i]));
    return r;
}
/* x86's maxps: a > b ? a : b (b where either is NaN, or both are zeros). */
static inline float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
/* x86's minps: a < b ? a : b. */
static inline float32x4_t min4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
static inline vf vf_max(vf a, vf b) {
    vf r;
    EACH(r, max4(a.v[i], b.v[i]));
    return r;
}
static inline vf vf_min(vf a, vf b) {
    vf r;
    EACH(r, min4(a.v[i], b.v[i]));
    return r;
}
static inline vf vf_abs(vf a) {
    vf r;
    EACH(r, vabsq_f32(a.v[i]));
    return r;
}
static inline vf vf_fmadd(vf a, vf b, vf c) {
    vf r;
    EACH(r, vfmaq_f32(c.v[i], a.v[i], b.v[i]));
    return r;
}
static inline vf vf_fnmadd(vf a, vf b, vf c) {
    vf r;
    EACH(r, vfmsq_f32(c.v[i], a.v[i], b.v[i]));
    return r;
}
static inline vf vf_floor(vf a) {
    vf r;
    EACH(r, vrndmq_f32(a.v[i]));
    return r;
}
/* kernels_vec_avx2.h's scalef: n clamped to [-126, 254] and split in two
   normal powers of two; the second product rounds once. */
static inline float32x4_t scalef4(float32x4_t y, float32x4_t n) {
    n = min4(max4(n, vdupq_n_f32(-126.0f)), vdupq_n_f32(254.0f));
    int32x4_t k = vcvtnq_s32_f32(n);
    int32x4_t k1 = vshrq_n_s32(k, 1), k2 = vsubq_s32(k, k1);
    float32x4_t p1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, vdupq_n_s32(127)), 23));
    float32x4_t p2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(y, p1), p2);
}
static inline vf vf_scalef(vf y, vf n) {
    vf r;
    EACH(r, scalef4(y.v[i], n.v[i]));
    return r;
}
static inline vf vf_from_vi(vi a) {
    vf r;
    EACH(r, vcvtq_f32_s32(a.v[i]));
    return r;
}
/* e where x is neither -inf nor NaN (cmpneq_oq), else +0. */
static inline vf vf_zero_where_neginf(vf x, vf e) {
    vf r;
    const float32x4_t ninf = vdupq_n_f32(-INFINITY);
    EACH(r, vreinterpretq_f32_u32(vandq_u32(
                vandq_u32(vmvnq_u32(vceqq_f32(x.v[i], ninf)), vceqq_f32(x.v[i], x.v[i])),
                vreinterpretq_u32_f32(e.v[i]))));
    return r;
}

/* The AVX-512 tree: halves (lanes 8-15 + 0-7), quarters, then (0 + 2) + (1 + 3). */
static inline float vf_reduce_add(vf v) {
    float32x4_t t_lo = vaddq_f32(v.v[2], v.v[0]), t_hi = vaddq_f32(v.v[3], v.v[1]);
    float32x4_t s = vaddq_f32(t_hi, t_lo);
    float s0 = vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2);
    float s1 = vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3);
    return s0 + s1;
}
/* Lane j = vf_reduce_add(v[j]), bit for bit, for 16 vectors at once: each
   vector's halves added as there, then lanes 0 + 2, 1 + 3 and 0 + 1 across
   four vectors at a time by zips. */
static inline vf vf_reduce_add16(const vf *v) {
    vf out;
    for (int g = 0; g < 4; g++) {
        float32x4_t s[4];
        for (int i = 0; i < 4; i++) {
            const vf *x = &v[4 * g + i];
            s[i] = vaddq_f32(vaddq_f32(x->v[3], x->v[1]), vaddq_f32(x->v[2], x->v[0]));
        }
#define F64(x) vreinterpretq_f64_f32(x)
#define F32(x) vreinterpretq_f32_f64(x)
        /* [a0 + a2, a1 + a3, b0 + b2, b1 + b3] */
        float32x4_t ab = vaddq_f32(F32(vzip1q_f64(F64(s[0]), F64(s[1]))), F32(vzip2q_f64(F64(s[0]), F64(s[1]))));
        float32x4_t cd = vaddq_f32(F32(vzip1q_f64(F64(s[2]), F64(s[3]))), F32(vzip2q_f64(F64(s[2]), F64(s[3]))));
#undef F64
#undef F32
        out.v[g] = vaddq_f32(vuzp1q_f32(ab, cd), vuzp2q_f32(ab, cd));
    }
    return out;
}
static inline float max1(float a, float b) { return a > b ? a : b; }
static inline float vf_reduce_max(vf v) {
    float32x4_t t_lo = max4(v.v[2], v.v[0]), t_hi = max4(v.v[3], v.v[1]);
    float32x4_t s = max4(t_hi, t_lo);
    float s0 = max1(vgetq_lane_f32(s, 0), vgetq_lane_f32(s, 2));
    float s1 = max1(vgetq_lane_f32(s, 1), vgetq_lane_f32(s, 3));
    return max1(s0, s1);
}

static inline vf vf_bf16(const uint16_t *p) {
    vf r;
    EACH(r, vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(p + 4 * i)), 16)));
    return r;
}
static inline vf vf_f16(const uint16_t *p) {
    vf r;
    EACH(r, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i))));
    return r;
}
static inline uint16x4_t bf16_round4(float32x4_t v) {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t r = vshrq_n_u32(
        vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)))), 16);
    uint32x4_t nan = vmvnq_u32(vceqq_f32(v, v));
    return vmovn_u32(vbslq_u32(nan, vdupq_n_u32(BF16_NAN), r));
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
    for (int i = 0; i < 4; i++) vst1_u16(p + 4 * i, bf16_round4(v.v[i]));
}
static inline vf vf_f16_spread4(const uint16_t *p, int n) {
    uint16_t t[4] = {0};
    memcpy(t, p, (size_t)(n < 4 ? n : 4) * sizeof(uint16_t));
    float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(t)));
    vf r = {{vdupq_laneq_f32(d, 0), vdupq_laneq_f32(d, 1), vdupq_laneq_f32(d, 2), vdupq_laneq_f32(d, 3)}};
    return r;
}
static inline vf vf_f16_first4(const uint16_t *p, int n) {
    uint16_t t[4] = {0};
    memcpy(t, p, (size_t)(n < 4 ? n : 4) * sizeof(uint16_t));
    vf r = {{vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(t))), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f),
             vdupq_n_f32(0.0f)}};
    return r;
}
static inline vf vf_load_first4(const float *p) {
    vf r = {{vld1q_f32(p), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}};
    return r;
}

/* vdpbf16ps's order: acc + k[2i+1] q[2i+1], then + k[2i] q[2i]. */
static inline float32x4_t dpbf16_4(float32x4_t acc, const uint16_t *k, const uint16_t *q) {
    uint32x4_t kv = vreinterpretq_u32_u16(vld1q_u16(k)), qv = vreinterpretq_u32_u16(vld1q_u16(q));
    const uint32x4_t high = vdupq_n_u32(0xffff0000u);
    float32x4_t k_odd = vreinterpretq_f32_u32(vandq_u32(kv, high));
    float32x4_t q_odd = vreinterpretq_f32_u32(vandq_u32(qv, high));
    float32x4_t k_even = vreinterpretq_f32_u32(vshlq_n_u32(kv, 16));
    float32x4_t q_even = vreinterpretq_f32_u32(vshlq_n_u32(qv, 16));
    acc = vaddq_f32(acc, vmulq_f32(k_odd, q_odd));
    return vaddq_f32(acc, vmulq_f32(k_even, q_even));
}
static inline vf vf_dpbf16(vf acc, const uint16_t *k, const uint16_t *q) {
    vf r;
    EACH(r, dpbf16_4(acc.v[i], k + 8 * i, q + 8 * i));
    return r;
}

/* The AVX-512 tree, per vector x: quarter k's (x[4k] + x[4k+2]) + (x[4k+1]
   + x[4k+3]), then (quarter 0 + 1) + (quarter 2 + 3); four vectors at a
   time, transposed so that a register's lanes are the four vectors. */
static inline vf vf_hsum16(const vf *v) {
    vf d;
    for (int m = 0; m < 4; m++) {
        const vf *x = v + 4 * m;
        float32x4_t quarter[4];
        for (int k = 0; k < 4; k++) {
            /* rows: vectors x[0..3]'s quarter k; columns after the transpose */
            float32x4x2_t ab = vtrnq_f32(x[0].v[k], x[1].v[k]), cd = vtrnq_f32(x[2].v[k], x[3].v[k]);
            float32x4_t col0 = vcombine_f32(vget_low_f32(ab.val[0]), vget_low_f32(cd.val[0]));
            float32x4_t col1 = vcombine_f32(vget_low_f32(ab.val[1]), vget_low_f32(cd.val[1]));
            float32x4_t col2 = vcombine_f32(vget_high_f32(ab.val[0]), vget_high_f32(cd.val[0]));
            float32x4_t col3 = vcombine_f32(vget_high_f32(ab.val[1]), vget_high_f32(cd.val[1]));
            quarter[k] = vaddq_f32(vaddq_f32(col0, col2), vaddq_f32(col1, col3));
        }
        d.v[m] = vaddq_f32(vaddq_f32(quarter[0], quarter[1]), vaddq_f32(quarter[2], quarter[3]));
    }
    return d;
}

static inline vi vi_zero(void) {
    vi r;
    EACH(r, vdupq_n_s32(0));
    return r;
}
/* Nearest, ties to even, as cvtps2dq, whose answer for NaN and anything
   outside int32 (an activation's NaN, or a group so small that 127 / its
   largest magnitude overflows) is INT32_MIN, where vcvtnq gives 0 or
   saturates. */
static inline vi vi_round(vf a) {
    vi r;
    const float32x4_t limit = vdupq_n_f32(2147483648.0f);
    EACH(r, vbslq_s32(vcaltq_f32(a.v[i], limit), vcvtnq_s32_f32(a.v[i]), vdupq_n_s32(INT32_MIN)));
    return r;
}
static inline vi vi_add(vi a, vi b) {
    vi r;
    EACH(r, vaddq_s32(a.v[i], b.v[i]));
    return r;
}
static inline vi vi_shl7(vi a) {
    vi r;
    EACH(r, vshlq_n_s32(a.v[i], 7));
    return r;
}
static inline int32_t vi_reduce_add(vi a) {
    return vaddvq_s32(vaddq_s32(vaddq_s32(a.v[0], a.v[1]), vaddq_s32(a.v[2], a.v[3])));
}
static inline void vi_store_i8(int8_t *p, vi a) {
    int16x8_t lo = vcombine_s16(vmovn_s32(a.v[0]), vmovn_s32(a.v[1]));
    int16x8_t hi = vcombine_s16(vmovn_s32(a.v[2]), vmovn_s32(a.v[3]));
    vst1q_s8(p, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
}
static inline void vi_store_i16(int16_t *p, vi a) {
    vst1q_s16(p, vcombine_s16(vmovn_s32(a.v[0]), vmovn_s32(a.v[1])));
    vst1q_s16(p + 8, vcombine_s16(vmovn_s32(a.v[2]), vmovn_s32(a.v[3])));
}

/* The 8-bit matmul's weights (kernels_arith.h): 16 lanes of two int16, lane l
   bytes 2l and 2l + 1 of 32 (v[i]: lanes 4i .. 4i + 3). */
typedef struct {
    int16x8_t v[4];
} vw;
static inline vw vw_load_i8(const int8_t *p) {
    int8x16_t a = vld1q_s8(p), b = vld1q_s8(p + 16);
    vw r = {{vmovl_s8(vget_low_s8(a)), vmovl_high_s8(a), vmovl_s8(vget_low_s8(b)), vmovl_high_s8(b)}};
    return r;
}
/* acc + lane l's two weights times x[0], x[1] (int16), exact in int32: the
   products widened, each lane's two added by a pairwise add. */
static inline vi vi_madd_i16(vi acc, vw w, const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, 4);
    int16x8_t b = vreinterpretq_s16_s32(vdupq_n_s32(pair));
    vi r;
    EACH(r, vaddq_s32(acc.v[i], vpaddq_s32(vmull_s16(vget_low_s16(w.v[i]), vget_low_s16(b)),
                                           vmull_high_s16(w.v[i], b))));
    return r;
}

static inline vb vb_load(const uint8_t *p) {
    vb r;
    EACH(r, vld1q_u8(p + 16 * i));
    return r;
}
static inline vb vb_load_first(const uint8_t *p, int n) {
    if (n >= 64) return vb_load(p);
    uint8_t t[64] = {0};
    memcpy(t, p, (size_t)n);
    return vb_load(t);
}
static inline vb vb_low(vb v) {
    vb r;
    EACH(r, vandq_u8(v.v[i], vdupq_n_u8(0x0f)));
    return r;
}
static inline vb vb_high(vb v) {
    vb r;
    EACH(r, vshrq_n_u8(v.v[i], 4));
    return r;
}

/* Lane l: the 4 bytes 4l .. 4l + 3 of w (< 16) times those of x, summed over
   the n pairs; exact in int32 (sdot, or the widening multiply and two
   pairwise adds without it). */
static inline vi vi_dot(const vb *w, const int8_t *const *x, const int n) {
    vi s = vi_zero();
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < 4; i++) {
            int8x16_t wv = vreinterpretq_s8_u8(w[j].v[i]), xv = vld1q_s8(x[j] + 16 * i);
#if defined(KERNELS_DOTPROD)
            s.v[i] = vdotq_s32(s.v[i], wv, xv);
#else
            int16x8_t lo = vmull_s8(vget_low_s8(wv), vget_low_s8(xv));
            int16x8_t hi = vmull_s8(vget_high_s8(wv), vget_high_s8(xv));
            s.v[i] = vaddq_s32(s.v[i], vpaddlq_s16(vpaddq_s16(lo, hi)));
#endif
        }
    }
    return s;
}

#undef EACH
