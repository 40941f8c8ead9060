/*
 * Fused CPU fake-quantization kernels for the fp4rl block formats.
 *
 * One pass over the data: each block is read once, its scale fields computed
 * and its dequantized values written. The arithmetic follows formats.md and is
 * exact: products such as |x| * r (24 x 8 significant bits) are formed in
 * double precision, where they fit without rounding, and the round-to-grid
 * steps operate on the bits of those exact doubles. On AVX-512, HiF4's nearest
 * rounding runs in float32 instead, 16 values a vector, its inexact products
 * taken through fused multiply-adds that round once (hif4_v_round says why that
 * is exact). The result is bit-identical to the float64 reference path in
 * fp4rl/formats on every build (the tests check it).
 *
 * Layout: `rows` rows of `len` contiguous float32 values, blocks along the row;
 * a partial last block behaves as if zero-padded. `noise` (optional) holds
 * uniform [0, 1) draws for stochastic rounding, rows of `noise_stride` values.
 * `tensor_scale` g != 0 applies a per-tensor scale: blocks quantize x / g and the
 * result is multiplied by g, both in float32 as the reference does.
 * Compile without -ffast-math: NaN checks and exact rounding depend on IEEE.
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

/* FMT_HIF4, ..., FMT_NVFP4_TILES: given by the compiler's -D flags, from the one
 * declaration of the codes (fp4rl/kernels/codes.py, FormatCode; c_defines() prints them). */
#if !defined(FMT_HIF4) || !defined(FMT_MXFP4) || !defined(FMT_NVFP4) || !defined(FMT_MXFP8) || \
    !defined(FMT_NVFP4_4O6) || !defined(FMT_NVFP4_TILES)
#error "compile with the format codes: fp4rl.kernels.codes.c_defines() gives the -D flags"
#endif

static inline uint64_t bits_of(double v) { uint64_t u; memcpy(&u, &v, 8); return u; }
static inline double from_bits(uint64_t u) { double v; memcpy(&v, &u, 8); return v; }

/* floor(log2 v) of a positive normal double (every float32 > 0 is one). */
static inline int floor_log2(double v) { return (int)((bits_of(v) >> 52) & 0x7FF) - 1023; }

/* 2^e for e in the normal double range. */
static inline double pow2(int e) { return from_bits((uint64_t)(e + 1023) << 52); }

/* Round a non-negative normal double to `frac` fraction bits, ties to even. */
static inline double round_frac_bits(double v, int frac)
{
    if (v == 0.0) return 0.0;
    const int drop = 52 - frac;
    uint64_t u = bits_of(v);
    u += (((uint64_t)1 << (drop - 1)) - 1) + ((u >> drop) & 1);
    u &= ~(((uint64_t)1 << drop) - 1);
    return from_bits(u);
}

/* Round scaled value t to an integer: nearest-even, or floor(t + u) when stochastic. */
static inline double round_step(double t, const float *u, int i)
{
    return u ? floor(t + (double)u[i]) : nearbyint(t);
}

/* Minifloat rounding of v >= 0: `mbits` fraction bits, min normal exponent `emin`. */
static inline double round_minifloat(double v, int mbits, int emin, double vmax,
                                     const float *u, int i)
{
    int e = v > 0.0 ? floor_log2(v) : emin;
    if (e < emin) e = emin;
    double q = round_step(v * pow2(mbits - e), u, i) * pow2(e - mbits);
    return q > vmax ? vmax : q;
}

/*
 * Copy a (possibly partial) block into buf, zero-padded and divided by the per-tensor
 * scale g (g == 0: none); returns 1 if any value is non-finite.
 */
static inline int load_block(const float *x, int n, int bs, float g, float *buf, float *amax)
{
    if (n == bs) {
        memcpy(buf, x, (size_t)bs * sizeof(float));
    } else {
        for (int i = 0; i < bs; i++) buf[i] = i < n ? x[i] : 0.0f;
    }
    if (g != 0.0f)
        for (int i = 0; i < bs; i++) buf[i] = buf[i] / g;
    /* The largest magnitude is the largest |x| bit pattern; NaN and Inf sort above all. */
    uint32_t m = 0;
    for (int i = 0; i < bs; i++) {
        uint32_t b;
        memcpy(&b, &buf[i], 4);
        b &= 0x7FFFFFFFu;
        m = b > m ? b : m;
    }
    memcpy(amax, &m, 4);
    return m >= 0x7F800000u;
}

/* y = sign(x) * magnitude (times the per-tensor scale g when g != 0). */
static inline void store_block(const float *buf, const float *mag, float *y, int n, float g)
{
    for (int i = 0; i < n; i++) {
        float v = copysignf(mag[i], buf[i]);
        y[i] = g != 0.0f ? v * g : v;
    }
}

/*
 * The arithmetic of each format, one block (or one value) at a time. The per-block
 * functions below and the column-lane kernels further down both call these, so each
 * format's rounding rules are written once.
 */

/* HiF4's level-1 scale s = E6M2(bf16(vmax c)), clamped; *r = bf16(1 / s). */
static inline double hif4_scale(double amax, double *r)
{
    double s = round_frac_bits(amax * 0.142578125, 7);               /* bf16(vmax * c) */
    s = s < 0x1p-48 ? 0x1p-48 : s;
    s = round_frac_bits(s > 49152.0 ? 49152.0 : s, 2);                /* E6M2 */
    *r = round_frac_bits(1.0 / s, 7);                                 /* bf16(1 / s) */
    return s;
}

/*
 * A quad's two factors from its level bits d8 = [v8 r >= 4] and
 * d16 = [v16 r 2^-d8 >= 2] = [v16 r >= 2^(1 + d8)], with d = d8 + d16 (0, 1 or 2,
 * computed without branches): |x| r 2^(2-d) is 4m before rounding and 4m s 2^(d-2) is
 * |y|, both exact powers of two times r or s.
 */
static inline void hif4_factors(double v8, double v16, double s, double r, double *fin,
                                double *fout)
{
    const double e8 = v8 * r >= 4.0 ? 1.0 : 0.0;
    const double d = e8 + (v16 * r >= 2.0 + 2.0 * e8 ? 1.0 : 0.0);
    *fin = 4.0 * r * (1.0 - 0.5 * d + 0.125 * d * (d - 1.0));        /* 4 r 2^-d */
    *fout = 0.25 * s * (1.0 + d + 0.5 * d * (d - 1.0));               /* s 2^(d-2) */
}

/* |y| of one HiF4 value: rha adds 1/2 before the floor, stochastic rounding adds u. */
static inline float hif4_value(float x, double fin, double fout, double offset)
{
    const double q = floor((double)fabsf(x) * fin + offset);
    return (float)((q < 7.0 ? q : 7.0) * fout);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/*
 * HiF4's nearest rounding in float32, 16 values a vector, the same bits as the float64
 * steps above. Two products are not exact in float32: v r against the level thresholds
 * and |x| fin (24 x 8 significant bits). Both are taken through a fused multiply-add,
 * which rounds the exact value once:
 * - the level bits: v r >= t exactly when fma(v, r, -t) >= 0 (rounding keeps the sign
 *   and never reaches 0 from a non-zero value of these magnitudes);
 * - the element: rha(|x| fin) = floor(|x| fin + 1/2), and the fma rounded towards minus
 *   infinity (AVX-512's per-instruction rounding) keeps that floor: a value at or above
 *   an integer k rounds down to k or above, one below k stays below. Any q >= 7 becomes
 *   7, so the clamp may come before the floor.
 * fin = 4 r 2^-d and fout = s 2^(d-2) are powers of two times r or s, and q fout holds 6
 * significant bits: both exact.
 */
#define HIF4_VECTOR 1

static inline __m512 hif4_v_round(__m512 a, __m512 v8, __m512 v16, __m512 r, __m512 r4,
                                  __m512 s4)
{
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    const __mmask16 e8 = _mm512_cmp_ps_mask(_mm512_fmadd_ps(v8, r, _mm512_set1_ps(-4.0f)),
                                            zero, _CMP_GE_OQ);
    const __m512 t16 = _mm512_mask_blend_ps(e8, _mm512_set1_ps(-2.0f), _mm512_set1_ps(-4.0f));
    const __mmask16 e16 = _mm512_cmp_ps_mask(_mm512_fmadd_ps(v16, r, t16), zero, _CMP_GE_OQ);
    const __m512 d = _mm512_mask_add_ps(_mm512_maskz_mov_ps(e8, one), e16,
                                        _mm512_maskz_mov_ps(e8, one), one);
    const __m512 fin = _mm512_scalef_ps(r4, _mm512_sub_ps(zero, d));
    const __m512 fout = _mm512_scalef_ps(s4, d);
    const __m512 t = _mm512_fmadd_round_ps(a, fin, _mm512_set1_ps(0.5f),
                                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 q = _mm512_roundscale_ps(_mm512_min_ps(t, _mm512_set1_ps(7.0f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_mul_ps(q, fout);
}

/* round_frac_bits on 8 doubles: the same integer steps on their bits */
static inline __m512d round_frac_pd(__m512d v, int frac)
{
    const int drop = 52 - frac;
    __m512i u = _mm512_castpd_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi64(u, (unsigned)drop),
                                         _mm512_set1_epi64(1));
    u = _mm512_add_epi64(u, _mm512_add_epi64(_mm512_set1_epi64(((int64_t)1 << (drop - 1)) - 1),
                                             odd));
    return _mm512_castsi512_pd(_mm512_and_si512(u, _mm512_set1_epi64(-((int64_t)1 << drop))));
}

/* hif4_scale of 8 blocks' amax (as doubles): s / 4 and 4 r, exact in float32 */
static inline void hif4_scale_pd(__m512d amax, __m256 *r, __m256 *r4, __m256 *s4)
{
    __m512d s = round_frac_pd(_mm512_mul_pd(amax, _mm512_set1_pd(0.142578125)), 7);
    s = _mm512_min_pd(_mm512_max_pd(s, _mm512_set1_pd(0x1p-48)), _mm512_set1_pd(49152.0));
    s = round_frac_pd(s, 2);
    const __m512d rd = round_frac_pd(_mm512_div_pd(_mm512_set1_pd(1.0), s), 7);
    *r = _mm512_cvtpd_ps(rd);
    *r4 = _mm512_cvtpd_ps(_mm512_mul_pd(rd, _mm512_set1_pd(4.0)));
    *s4 = _mm512_cvtpd_ps(_mm512_mul_pd(s, _mm512_set1_pd(0.25)));
}

static inline __m512 join_ps(__m256 lo, __m256 hi)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                               _mm256_castps_pd(hi), 1));
}

/* The level-1 factors of 16 blocks, one a lane, from their amax: r, 4 r and s / 4, the
 * arithmetic of hif4_scale (a lane's NaN or Inf gives values the caller replaces) */
static inline void hif4_v_scales(__m512 amax, __m512 *r, __m512 *r4, __m512 *s4)
{
    __m256 rl, rh, r4l, r4h, s4l, s4h;
    hif4_scale_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(amax)), &rl, &r4l, &s4l);
    hif4_scale_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                      _mm512_castps_pd(amax), 1))), &rh, &r4h, &s4h);
    *r = join_ps(rl, rh);
    *r4 = join_ps(r4l, r4h);
    *s4 = join_ps(s4l, s4h);
}

static inline __m512 abs_ps(__m512 x)
{
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x),
                                                _mm512_set1_epi32(0x7FFFFFFF)));
}

static inline __m512i max_bits(__m512i a, __m512i b) { return _mm512_max_epu32(a, b); }

/* 16 values as float32: as they lie, or bfloat16 widened exactly */
static inline __m512 load16(const float *x, const uint16_t *xb, int64_t at)
{
    if (xb)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + at))), 16));
    return _mm512_loadu_ps(x + at);
}

/* 16 block values to y as float32, or as bfloat16: every block value (6 significant bits)
 * and the quiet NaN are exact there, so their bf16 bits are the float32 bits' upper half */
static inline void store16(void *y, int64_t at, __m512 v, int out_bf16)
{
    if (out_bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + at),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    else
        _mm512_storeu_ps((float *)y + at, v);
}

/* sign(x) |y|, or the quiet NaN where `bad` is set */
static inline __m512 signed_or_nan(__m512 mag, __m512 x, __mmask16 bad)
{
    const __m512i sx = _mm512_and_si512(_mm512_castps_si512(x),
                                        _mm512_set1_epi32((int)0x80000000u));
    const __m512i v = _mm512_or_si512(_mm512_castps_si512(mag), sx);
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(v, bad, _mm512_set1_epi32(0x7FC00000)));
}

/* The v16 and v8 of each of 16 values (bit patterns of |x|): maxima within each 4-lane
 * quad by two in-lane swaps, then across an octet's two quads by a swap of 128-bit lanes */
static inline void quad_octet_max(__m512 x, __m512i *m16, __m512i *m8)
{
    __m512i m = _mm512_castps_si512(abs_ps(x));
    m = max_bits(m, _mm512_shuffle_epi32(m, (_MM_PERM_ENUM)0xB1));
    *m16 = max_bits(m, _mm512_shuffle_epi32(m, (_MM_PERM_ENUM)0x4E));
    *m8 = max_bits(*m16, _mm512_shuffle_i32x4(*m16, *m16, 0xB1));
}

/*
 * `nb` (<= 16) whole blocks of 64 contiguous values at `at` (float32 x or bfloat16 xb),
 * nearest rounding, no tensor scale, written to y at `at`. Maxima are taken on the bit
 * patterns of |x| (ordered as the values, NaN and Inf above all). The blocks' scales are
 * computed together, one a lane, between a pass for the maxima and one for the values.
 */
static void hif4_blocks_v(const float *x, const uint16_t *xb, int64_t at, int nb, void *y,
                          int out_bf16)
{
    uint32_t amax[16] = {0};
    for (int b = 0; b < nb; b++) {
        __m512i top = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++)
            top = max_bits(top, _mm512_castps_si512(abs_ps(load16(x, xb, at + 64 * b + 16 * v))));
        amax[b] = _mm512_reduce_max_epu32(top);
    }
    const __m512i top = _mm512_loadu_si512(amax);
    const __mmask16 bad = _mm512_cmpge_epu32_mask(top, _mm512_set1_epi32(0x7F800000));
    __m512 r, r4, s4;
    hif4_v_scales(_mm512_castsi512_ps(top), &r, &r4, &s4);
    float rs[16], r4s[16], s4s[16];
    _mm512_storeu_ps(rs, r);
    _mm512_storeu_ps(r4s, r4);
    _mm512_storeu_ps(s4s, s4);
    for (int b = 0; b < nb; b++) {
        const __m512 rb = _mm512_set1_ps(rs[b]), r4b = _mm512_set1_ps(r4s[b]),
                     s4b = _mm512_set1_ps(s4s[b]);
        const __mmask16 bad_b = (bad >> b) & 1 ? 0xFFFF : 0;
        for (int v = 0; v < 4; v++) {
            const int64_t i = at + 64 * b + 16 * v;
            const __m512 xv = load16(x, xb, i);
            __m512i m16, m8;
            quad_octet_max(xv, &m16, &m8);
            const __m512 mag = hif4_v_round(abs_ps(xv), _mm512_castsi512_ps(m8),
                                            _mm512_castsi512_ps(m16), rb, r4b, s4b);
            store16(y, i, signed_or_nan(mag, xv, bad_b), out_bf16);
        }
    }
}

/*
 * One stripe of 64 rows by 16 columns at `at` (rows `cols` apart), blocks along the
 * columns, written to y at the same places: each column one lane, its quads' and octets'
 * maxima plain vector maxima of rows. The stripe is read twice, the second time from the
 * first level of cache; a lane with a NaN or an Inf is all NaN.
 */
static void hif4_cols_v(const float *x, const uint16_t *xb, int64_t at, int64_t cols, void *y,
                        int out_bf16)
{
    __m512i m16[16], top = _mm512_setzero_si512();
    for (int k = 0; k < 16; k++) {
        __m512i m = _mm512_setzero_si512();
        for (int i = 4 * k; i < 4 * k + 4; i++)
            m = max_bits(m, _mm512_castps_si512(abs_ps(load16(x, xb, at + i * cols))));
        m16[k] = m;
        top = max_bits(top, m);
    }
    const __mmask16 bad = _mm512_cmpge_epu32_mask(top, _mm512_set1_epi32(0x7F800000));
    __m512 r, r4, s4;
    hif4_v_scales(_mm512_castsi512_ps(top), &r, &r4, &s4);
    for (int k = 0; k < 16; k++) {
        const __m512 v16 = _mm512_castsi512_ps(m16[k]);
        const __m512 v8 = _mm512_castsi512_ps(max_bits(m16[k], m16[k ^ 1]));
        for (int i = 4 * k; i < 4 * k + 4; i++) {
            const __m512 xv = load16(x, xb, at + i * cols);
            const __m512 mag = hif4_v_round(abs_ps(xv), v8, v16, r, r4, s4);
            store16(y, at + i * cols, signed_or_nan(mag, xv, bad), out_bf16);
        }
    }
}
#endif

/* The MX shared exponent: floor(log2 amax) - offset, at least -127 (also for amax 0). */
static inline int mx_scale_exp(float amax, int scale_offset)
{
    const int E = amax > 0.0f ? floor_log2((double)amax) - scale_offset : -127;
    return E < -127 ? -127 : E;
}

/* NVFP4's E4M3 block scale mapping amax to `top` (6, or 4 for Four Over Six): amax / top,
 * at most 448, rounded to E4M3. */
static inline double nvfp4_scale(float amax, double top)
{
    const double s = (double)amax / top;
    return round_minifloat(s > 448.0 ? 448.0 : s, 3, -6, 448.0, NULL, 0);
}

/* An NVFP4 element magnitude of |x| = a under block scale s: E2M1(a / s) * s (0 if s is). */
static inline double nvfp4_element(double a, double s, const float *u, int i)
{
    return s > 0.0 ? round_minifloat(a / s, 1, 0, 6.0, u, i) * s : 0.0;
}

/*
 * Round one HiF4 block's magnitudes quad by quad. Inlined twice, so that the
 * nearest-rounding copy (u == NULL, the hot path) has a constant offset and its 4-value
 * groups vectorize.
 */
static inline void hif4_round(const float *buf, float *mag, int n, double s, double r,
                              const double *v8, const double *v16, const float *u)
{
    for (int k = 0; k < 16; k++) {
        double fin, fout;
        hif4_factors(v8[k >> 1], v16[k], s, r, &fin, &fout);
        for (int t = 0; t < 4; t++) {
            const int i = 4 * k + t;
            mag[i] = hif4_value(buf[i], fin, fout, u ? (i < n ? (double)u[i] : 0.0) : 0.5);
        }
    }
}

static void hif4_block(const float *x, float *y, int n, const float *u)
{
#ifdef HIF4_VECTOR
    if (n == 64 && u == NULL) {
        hif4_blocks_v(x, NULL, 0, 1, y, 0);
        return;
    }
#endif
    float buf[64], mag[64], amax;
    if (load_block(x, n, 64, 0.0f, buf, &amax)) { for (int i = 0; i < n; i++) y[i] = NAN; return; }
    double v16[16], v8[8];
    for (int k = 0; k < 16; k++) {
        float m = 0.0f;
        for (int i = 0; i < 4; i++) { float a = fabsf(buf[4 * k + i]); m = a > m ? a : m; }
        v16[k] = m;
    }
    for (int j = 0; j < 8; j++) v8[j] = v16[2 * j] > v16[2 * j + 1] ? v16[2 * j] : v16[2 * j + 1];
    double r;
    const double s = hif4_scale((double)amax, &r);
    if (u)
        hif4_round(buf, mag, n, s, r, v8, v16, u);
    else
        hif4_round(buf, mag, n, s, r, v8, v16, NULL);
    store_block(buf, mag, y, n, 0.0f);
}

/* MXFP4 (E2M1 elements, saturating at 6) and MXFP8 (E4M3, saturating at 448). */
static void mx_block(const float *x, float *y, int n, const float *u, int elem_mbits,
                     int elem_emin, double elem_max, int scale_offset)
{
    float buf[32], mag[32], amax;
    if (load_block(x, n, 32, 0.0f, buf, &amax)) { for (int i = 0; i < n; i++) y[i] = NAN; return; }
    const int E = mx_scale_exp(amax, scale_offset);
    const double inv = pow2(-E), sc = pow2(E);
    for (int i = 0; i < n; i++) {
        double v = (double)fabsf(buf[i]) * inv;
        mag[i] = (float)(round_minifloat(v, elem_mbits, elem_emin, elem_max, u, i) * sc);
    }
    store_block(buf, mag, y, n, 0.0f);
}

static void nvfp4_block(const float *x, float *y, int n, const float *u, float g)
{
    float buf[16], mag[16], amax;
    if (load_block(x, n, 16, g, buf, &amax)) { for (int i = 0; i < n; i++) y[i] = NAN; return; }
    const double s = nvfp4_scale(amax, 6.0);
    for (int i = 0; i < n; i++) mag[i] = (float)nvfp4_element((double)fabsf(buf[i]), s, u, i);
    store_block(buf, mag, y, n, g);
}

/*
 * Four Over Six: the block scaled to a largest magnitude of 6 (NVFP4's rule) or of 4,
 * whichever leaves the smaller squared error, 6 on a tie; both candidates round with the
 * same draws. The errors are compared exactly, as the reference does
 * (fp4rl.formats.nvfp4.four_errs_less, which says why): in units of the grid g of the
 * scale to 6, sum(P4^2 - P6^2) - 2 sum((P4 - P6) a / g), a / g split into its integer
 * part and two 24-bit fraction limbs, each limb summed exactly in 64-bit integers and
 * carried into the integer part, whose sign is the difference's.
 */
static void nvfp4_candidate(const float *buf, double *mag, double s, const float *u, int n)
{
    for (int i = 0; i < 16; i++)  /* the padding (i >= n) is 0 and stays 0 */
        mag[i] = nvfp4_element((double)fabsf(buf[i]), s, i < n ? u : NULL, i);
}

static inline int64_t floor_limb(int64_t v) { return (v >= 0 ? v : v - 0xFFFFFF) / 0x1000000; }

static int four_errs_less(const float *buf, const double *m4, const double *m6, double s6)
{
    int e = s6 > 0.0 ? floor_log2(s6) : -6;
    const double inv_g = pow2(4 - (e < -6 ? -6 : e));
    int64_t top = 0, mid = 0, low = 0;
    for (int i = 0; i < 16; i++) {
        const double p4 = m4[i] * inv_g, p6 = m6[i] * inv_g;  /* integers below 2^9 */
        if (p4 == p6) continue;
        const double r = (double)fabsf(buf[i]) * inv_g;        /* 48 fraction bits */
        const double c0 = floor(r), f = (r - c0) * 16777216.0, c1 = floor(f);
        const double c2 = (f - c1) * 16777216.0;
        const int64_t d = (int64_t)p4 - (int64_t)p6;
        top += (int64_t)p4 * (int64_t)p4 - (int64_t)p6 * (int64_t)p6 - 2 * d * (int64_t)c0;
        mid -= 2 * d * (int64_t)c1;
        low -= 2 * d * (int64_t)c2;
    }
    mid += floor_limb(low);
    top += floor_limb(mid);
    return top < 0;
}

static void nvfp4_4o6_block(const float *x, float *y, int n, const float *u, float g)
{
    float buf[16], mag[16], amax;
    if (load_block(x, n, 16, g, buf, &amax)) { for (int i = 0; i < n; i++) y[i] = NAN; return; }
    double m6[16], m4[16];
    const double s6 = nvfp4_scale(amax, 6.0);
    nvfp4_candidate(buf, m6, s6, u, n);
    nvfp4_candidate(buf, m4, nvfp4_scale(amax, 4.0), u, n);
    const int four = four_errs_less(buf, m4, m6, s6);
    for (int i = 0; i < 16; i++) mag[i] = (float)(four ? m4[i] : m6[i]);
    store_block(buf, mag, y, n, g);
}

static const int BLOCK[6] = {64, 32, 16, 32, 16, 16};

static void quantize_block(int fmt, const float *xb, float *yb, int n, const float *ub, float g)
{
    switch (fmt) {
    case FMT_HIF4: hif4_block(xb, yb, n, ub); break;
    case FMT_MXFP4: mx_block(xb, yb, n, ub, 1, 0, 6.0, 2); break;
    case FMT_NVFP4: nvfp4_block(xb, yb, n, ub, g); break;
    case FMT_NVFP4_4O6: nvfp4_4o6_block(xb, yb, n, ub, g); break;
    default: mx_block(xb, yb, n, ub, 3, -6, 448.0, 8); break;
    }
}

/*
 * NVFP4 in 16 x 16 tiles: one E4M3 scale for 16 neighbouring vectors' blocks. Value j of
 * vector v lies at x[v * vstride + j * pstride] (rows: vstride = len, pstride = 1;
 * columns: the other way round), its draw at noise[v * noise_stride + j]. A tile holding
 * a NaN or an Inf becomes NaN.
 */
static void nvfp4_tile(const float *x, float *y, int64_t vstride, int64_t pstride, int nv,
                       int np, const float *noise, int64_t noise_stride, float g)
{
    float buf[16][16];
    uint32_t m = 0;
    for (int v = 0; v < nv; v++)
        for (int j = 0; j < np; j++) {
            const float a = x[v * vstride + j * pstride];
            buf[v][j] = g != 0.0f ? a / g : a;
            uint32_t b;
            memcpy(&b, &buf[v][j], 4);
            b &= 0x7FFFFFFFu;
            m = b > m ? b : m;
        }
    float amax;
    memcpy(&amax, &m, 4);
    const int bad = m >= 0x7F800000u;
    const double s = bad ? 0.0 : nvfp4_scale(amax, 6.0);
    for (int v = 0; v < nv; v++)
        for (int j = 0; j < np; j++) {
            float out = NAN;
            if (!bad) {
                const float *u = noise ? noise + v * noise_stride : NULL;
                out = copysignf((float)nvfp4_element((double)fabsf(buf[v][j]), s, u, j), buf[v][j]);
                out = g != 0.0f ? out * g : out;
            }
            y[v * vstride + j * pstride] = out;
        }
}

/* Every tile of `nvec` vectors of `len` values (the layout of nvfp4_tile). */
static void quantize_tiles(const float *x, float *y, int64_t nvec, int64_t len, int64_t vstride,
                           int64_t pstride, const float *noise, int64_t noise_stride, float g,
                           int nthreads)
{
    const int64_t across = (len + 15) / 16, total = ((nvec + 15) / 16) * across;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < total; t++) {
        const int64_t v0 = (t / across) * 16, j0 = (t % across) * 16;
        const int nv = (int)(nvec - v0 < 16 ? nvec - v0 : 16);
        const int np = (int)(len - j0 < 16 ? len - j0 : 16);
        const int64_t at = v0 * vstride + j0 * pstride;
        nvfp4_tile(x + at, y + at, vstride, pstride, nv, np,
                   noise ? noise + v0 * noise_stride + j0 : NULL, noise_stride, g);
    }
}

int fp4rl_quantize(int fmt, const float *x, float *y, int64_t rows, int64_t len,
                   const float *noise, int64_t noise_stride, float tensor_scale, int nthreads)
{
    if (fmt < 0 || fmt > FMT_NVFP4_TILES) return -1;
    if (fmt == FMT_NVFP4_TILES) {
        quantize_tiles(x, y, rows, len, len, 1, noise, noise_stride, tensor_scale, nthreads);
        return 0;
    }
    const int bs = BLOCK[fmt];
    const int64_t nb = (len + bs - 1) / bs;
    const int64_t total = rows * nb;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < total; b++) {
        const int64_t row = b / nb, col = (b % nb) * bs;
        const int n = (int)(len - col < bs ? len - col : bs);
        const float *ub = noise ? noise + row * noise_stride + col : NULL;
        quantize_block(fmt, x + row * len + col, y + row * len + col, n, ub, tensor_scale);
    }
    return 0;
}

/*
 * Quantization along axis 0 of a row-major (rows x cols) matrix: blocks of consecutive
 * rows within a column. The nearest-rounding path is "vertical": a stripe of one block
 * of rows by LANES neighbouring columns is processed with the columns as SIMD lanes, so
 * every step of a block's arithmetic runs on LANES blocks at once and the matrix is read
 * and written row by row, without a transposed copy. The lane kernels apply the same
 * per-format arithmetic as the block functions above, one lane per block.
 */
enum { LANES = 64 };
typedef float lanes_f[LANES];

/* Largest |x| per lane; a lane whose block holds a NaN or an Inf is flagged in `bad`. */
static inline void lanes_amax(const lanes_f *buf, int bs, float *amax, int *bad)
{
    uint32_t m[LANES] = {0};
    for (int i = 0; i < bs; i++)
        for (int c = 0; c < LANES; c++) {
            uint32_t b;
            memcpy(&b, &buf[i][c], 4);
            b &= 0x7FFFFFFFu;
            m[c] = b > m[c] ? b : m[c];
        }
    for (int c = 0; c < LANES; c++) {
        memcpy(&amax[c], &m[c], 4);
        bad[c] = m[c] >= 0x7F800000u;
    }
}

static void hif4_lanes(const lanes_f *buf, lanes_f *mag, const float *amax)
{
#ifdef HIF4_VECTOR
    /* 16 lanes a vector; a lane's quads and octets are rows, so their maxima are plain
     * vector maxima (a NaN lane's values are replaced by the caller) */
    for (int c0 = 0; c0 < LANES; c0 += 16) {
        __m512 r, r4, s4;
        hif4_v_scales(_mm512_loadu_ps(amax + c0), &r, &r4, &s4);
        for (int j = 0; j < 8; j++) {
            __m512 a[8], m16[2];
            for (int i = 0; i < 8; i++) a[i] = abs_ps(_mm512_loadu_ps(buf[8 * j + i] + c0));
            for (int h = 0; h < 2; h++)
                m16[h] = _mm512_max_ps(_mm512_max_ps(a[4 * h], a[4 * h + 1]),
                                       _mm512_max_ps(a[4 * h + 2], a[4 * h + 3]));
            const __m512 m8 = _mm512_max_ps(m16[0], m16[1]);
            for (int i = 0; i < 8; i++)
                _mm512_storeu_ps(mag[8 * j + i] + c0,
                                 hif4_v_round(a[i], m8, m16[i >> 2], r, r4, s4));
        }
    }
#else
    double v16[16][LANES], v8[8][LANES], s[LANES], r[LANES];
    for (int k = 0; k < 16; k++)
        for (int c = 0; c < LANES; c++) {
            float m = 0.0f;
            for (int i = 0; i < 4; i++) { float a = fabsf(buf[4 * k + i][c]); m = a > m ? a : m; }
            v16[k][c] = m;
        }
    for (int j = 0; j < 8; j++)
        for (int c = 0; c < LANES; c++)
            v8[j][c] = v16[2 * j][c] > v16[2 * j + 1][c] ? v16[2 * j][c] : v16[2 * j + 1][c];
    for (int c = 0; c < LANES; c++) s[c] = hif4_scale((double)amax[c], &r[c]);
    for (int k = 0; k < 16; k++) {
        double fin[LANES], fout[LANES];
        for (int c = 0; c < LANES; c++)
            hif4_factors(v8[k >> 1][c], v16[k][c], s[c], r[c], &fin[c], &fout[c]);
        for (int i = 4 * k; i < 4 * k + 4; i++)
            for (int c = 0; c < LANES; c++) mag[i][c] = hif4_value(buf[i][c], fin[c], fout[c], 0.5);
    }
#endif
}

static void mx_lanes(const lanes_f *buf, lanes_f *mag, const float *amax, int elem_mbits,
                     int elem_emin, double elem_max, int scale_offset)
{
    double inv[LANES], sc[LANES];
    for (int c = 0; c < LANES; c++) {
        const int E = mx_scale_exp(amax[c], scale_offset);
        inv[c] = pow2(-E);
        sc[c] = pow2(E);
    }
    for (int i = 0; i < 32; i++)
        for (int c = 0; c < LANES; c++) {
            const double v = (double)fabsf(buf[i][c]) * inv[c];
            mag[i][c] = (float)(round_minifloat(v, elem_mbits, elem_emin, elem_max, NULL, 0) * sc[c]);
        }
}

static void nvfp4_lanes(const lanes_f *buf, lanes_f *mag, const float *amax)
{
    double s[LANES];
    for (int c = 0; c < LANES; c++) s[c] = nvfp4_scale(amax[c], 6.0);
    for (int i = 0; i < 16; i++)
        for (int c = 0; c < LANES; c++)
            mag[i][c] = (float)nvfp4_element((double)fabsf(buf[i][c]), s[c], NULL, 0);
}

/*
 * One block of `bs` (the format's block size) rows by LANES lanes, each lane one block:
 * out = sign(buf) * Q(|buf|) * scale, a lane whose block holds a NaN or an Inf all NaN.
 * `buf` is already divided by the per-tensor scale where there is one.
 */
static void lanes_quantize(int fmt, const lanes_f *buf, lanes_f *out, float scale)
{
    const int bs = BLOCK[fmt];
    float amax[LANES];
    int bad[LANES];
    lanes_amax(buf, bs, amax, bad);
    switch (fmt) {
    case FMT_HIF4: hif4_lanes(buf, out, amax); break;
    case FMT_MXFP4: mx_lanes(buf, out, amax, 1, 0, 6.0, 2); break;
    case FMT_NVFP4: nvfp4_lanes(buf, out, amax); break;
    default: mx_lanes(buf, out, amax, 3, -6, 448.0, 8); break;
    }
    /* A block holding a NaN or an Inf becomes the quiet NaN, selected by bit masks. */
    uint32_t keep[LANES], nan_bits[LANES];
    for (int c = 0; c < LANES; c++) {
        keep[c] = bad[c] ? 0u : ~0u;
        nan_bits[c] = bad[c] ? 0x7FC00000u : 0u;
    }
    for (int i = 0; i < bs; i++)
        for (int c = 0; c < LANES; c++) {
            const float v = copysignf(out[i][c], buf[i][c]) * scale;
            uint32_t b;
            memcpy(&b, &v, 4);
            b = (b & keep[c]) | nan_bits[c];
            memcpy(&out[i][c], &b, 4);
        }
}

/* One stripe: n (<= bs) rows by w (<= LANES) columns at x, rows `stride` apart. */
static void quantize_stripe(int fmt, const float *x, float *y, int64_t stride, int n, int w,
                            float g)
{
    const int bs = BLOCK[fmt];
    lanes_f buf[64], out[64];
    if (n < bs || w < LANES) memset(buf, 0, sizeof(buf));
    for (int i = 0; i < n; i++) memcpy(buf[i], x + i * stride, (size_t)w * sizeof(float));
    if (g != 0.0f)
        for (int i = 0; i < bs; i++)
            for (int c = 0; c < LANES; c++) buf[i][c] = buf[i][c] / g;
    lanes_quantize(fmt, buf, out, g != 0.0f ? g : 1.0f);
    for (int i = 0; i < n; i++) memcpy(y + i * stride, out[i], (size_t)w * sizeof(float));
}

/*
 * Stochastic rounding along axis 0 (and Four Over Six) keeps the per-block functions: a
 * tile of COL_TILE columns is gathered row by row, its blocks quantized, and scattered
 * back. `noise` (or NULL) is laid out as rows along the axis: (cols x noise_stride).
 */
enum { COL_TILE = 64 };

static void quantize_tile_gathered(int fmt, const float *x, float *y, int64_t cols, int n, int w,
                                   const float *noise, int64_t noise_stride, float g)
{
    float in[COL_TILE][64], out[COL_TILE][64];
    for (int i = 0; i < n; i++)
        for (int t = 0; t < w; t++) in[t][i] = x[i * cols + t];
    for (int t = 0; t < w; t++)
        quantize_block(fmt, in[t], out[t], n, noise ? noise + t * noise_stride : NULL, g);
    for (int i = 0; i < n; i++)
        for (int t = 0; t < w; t++) y[i * cols + t] = out[t][i];
}

int fp4rl_quantize_cols(int fmt, const float *x, float *y, int64_t rows, int64_t cols,
                        const float *noise, int64_t noise_stride, float tensor_scale,
                        int nthreads)
{
    if (fmt < 0 || fmt > FMT_NVFP4_TILES) return -1;
    if (fmt == FMT_NVFP4_TILES) {
        quantize_tiles(x, y, cols, rows, 1, cols, noise, noise_stride, tensor_scale, nthreads);
        return 0;
    }
    /* Four Over Six has no lane kernel: its blocks are gathered as stochastic ones are */
    const int gather = noise || fmt == FMT_NVFP4_4O6;
    const int bs = BLOCK[fmt], width = gather ? COL_TILE : LANES;
    const int64_t stripes = (rows + bs - 1) / bs, tiles = (cols + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < stripes * tiles; b++) {
        const int64_t row0 = (b / tiles) * bs, col0 = (b % tiles) * width;
        const int n = (int)(rows - row0 < bs ? rows - row0 : bs);
        const int w = (int)(cols - col0 < width ? cols - col0 : width);
        const int64_t at = row0 * cols + col0;
        if (gather)
            quantize_tile_gathered(fmt, x + at, y + at, cols, n, w,
                                   noise ? noise + col0 * noise_stride + row0 : NULL,
                                   noise_stride, tensor_scale);
        else
            quantize_stripe(fmt, x + at, y + at, cols, n, w, tensor_scale);
    }
    return 0;
}

/* Quantize one row block by block (block-only scaling). */
static void quantize_row(int fmt, const float *x, float *y, int64_t len)
{
    const int bs = BLOCK[fmt];
    int64_t col = 0;
#ifdef HIF4_VECTOR
    if (fmt == FMT_HIF4) {  /* whole blocks 16 at a time, their scales together */
        col = len - len % 64;
        for (int64_t c0 = 0; c0 < col; c0 += 64 * 16) {
            const int64_t nb = (col - c0) / 64;
            hif4_blocks_v(x, NULL, c0, nb < 16 ? (int)nb : 16, y, 0);
        }
    }
#endif
    for (; col < len; col += bs)
        quantize_block(fmt, x + col, y + col, (int)(len - col < bs ? len - col : bs), NULL, 0.0f);
}

/*
 * Keep the `keep` largest magnitudes of every `group` consecutive values (a partial last
 * group is zero-padded); ties go to the lower index, exactly as fp4rl.recovery.sparsity.
 * Dropped values become +0. The ranks are counted without branches (random data would
 * mispredict every comparison), with a fixed-size copy for the common 2:4 pattern.
 */
static inline void sparsify_group(float *v, const float *a, int n, int keep, int group)
{
    int rank[64];
    for (int k = 0; k < group; k++) rank[k] = 0;
    for (int i = 0; i < group; i++)
        for (int j = i + 1; j < group; j++) {
            const int later_wins = a[j] > a[i];
            rank[i] += later_wins;
            rank[j] += 1 - later_wins;
        }
    for (int k = 0; k < n; k++) v[k] = rank[k] < keep ? v[k] : 0.0f;
}

static inline void sparsify_group4(float *v, int keep)
{
    const float a0 = fabsf(v[0]), a1 = fabsf(v[1]), a2 = fabsf(v[2]), a3 = fabsf(v[3]);
    /* rank = larger values before + larger-or-equal values after (ties: lower index wins) */
    const int r0 = (a1 > a0) + (a2 > a0) + (a3 > a0);
    const int r1 = (a0 >= a1) + (a2 > a1) + (a3 > a1);
    const int r2 = (a0 >= a2) + (a1 >= a2) + (a3 > a2);
    const int r3 = (a0 >= a3) + (a1 >= a3) + (a2 >= a3);
    v[0] = r0 < keep ? v[0] : 0.0f;
    v[1] = r1 < keep ? v[1] : 0.0f;
    v[2] = r2 < keep ? v[2] : 0.0f;
    v[3] = r3 < keep ? v[3] : 0.0f;
}

static void sparsify_row(float *v, int64_t len, int keep, int group)
{
    float a[64];
    int64_t start = 0;
    if (group == 4)
        for (; start + 4 <= len; start += 4) sparsify_group4(v + start, keep);
    for (; start < len; start += group) {
        const int n = (int)(len - start < group ? len - start : group);
        for (int k = 0; k < group; k++) a[k] = k < n ? fabsf(v[start + k]) : 0.0f;
        sparsify_group(v + start, a, n, keep, group);
    }
}

/* One row of Rollout-ResQ: q = Q(x) and r = S(Q(x - q)), both float32. */
static void resq_row(int fmt, const float *x, float *q, float *r, int64_t len, int keep,
                     int group)
{
    quantize_row(fmt, x, q, len);
    for (int64_t i = 0; i < len; i++) r[i] = x[i] - q[i];
    quantize_row(fmt, r, r, len);
    if (group > 0) sparsify_row(r, len, keep, group);
}

/* float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN), as torch does. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bfloat16 bits -> float32 (exact). */
static inline float bf16_to_f32(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/*
 * One pass per row over `rows` rows of `len` values, with row buffers. Reads float32 rows
 * (x) or bfloat16 rows (xb, widened exactly first). Writes the folded float32 Rollout-ResQ
 * activation (sum != NULL), or its two terms as bfloat16 (q_out, r_out), or Q(x) alone as
 * bfloat16 (q_out, r_out == NULL); S keeps `keep` of every `group` values (group == 0:
 * dense). Block-only scaling: NVFP4's per-tensor scale needs the whole tensor first and
 * takes the unfused path.
 */
static int row_pass(int fmt, const float *x, const uint16_t *xb, int64_t rows, int64_t len,
                    int keep, int group, int nthreads, float *sum, uint16_t *q_out,
                    uint16_t *r_out)
{
    if (fmt < 0 || fmt > FMT_MXFP8 || fmt == FMT_NVFP4 || group < 0 || group > 64) return -1;
    int status = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t row = 0; row < rows; row++) {
        float *q = malloc((size_t)len * 3 * sizeof(float));
        if (q == NULL) {
#pragma omp atomic write
            status = -2;
            continue;
        }
        float *r = q + len;
        const int64_t at = row * len;
        const float *in = x + at;
        if (xb) {
            float *wide = r + len;
            for (int64_t i = 0; i < len; i++) wide[i] = bf16_to_f32(xb[at + i]);
            in = wide;
        }
        if (sum || r_out)
            resq_row(fmt, in, q, r, len, keep, group);
        else
            quantize_row(fmt, in, q, len);
        for (int64_t i = 0; i < len; i++) {
            if (sum) {
                sum[at + i] = q[i] + r[i];
            } else {
                q_out[at + i] = f32_to_bf16(q[i]);
                if (r_out) r_out[at + i] = f32_to_bf16(r[i]);
            }
        }
        free(q);
    }
    return status;
}

/* Rollout-ResQ activation, fused: out = Q(x) + S(Q(x - Q(x))) along each row. */
int fp4rl_resq(int fmt, const float *x, float *out, int64_t rows, int64_t len, int keep,
               int group, int nthreads)
{
    return row_pass(fmt, x, NULL, rows, len, keep, group, nthreads, out, NULL, NULL);
}

/*
 * Rollout-ResQ's two GEMM operands in bfloat16, for a bf16 GEMM that multiplies both by
 * Q(W): q_out = Q(x) and r_out = S(Q(x - Q(x))), each exact in bf16 (their sum need not
 * be, so they stay apart): one pass instead of a quantization, the fused sum, a
 * difference and two casts. Row for row the same values as fp4rl_resq's two terms.
 */
int fp4rl_resq_terms(int fmt, const float *x, uint16_t *q_out, uint16_t *r_out,
                     int64_t rows, int64_t len, int keep, int group, int nthreads)
{
    return row_pass(fmt, x, NULL, rows, len, keep, group, nthreads, NULL, q_out, r_out);
}

/* fp4rl_resq_terms of bfloat16 rows (a bf16 engine's activations, read without a float32
 * copy; widening is exact, so the terms are those of the float32 rows). */
int fp4rl_resq_terms_bf16(int fmt, const uint16_t *x, uint16_t *q_out, uint16_t *r_out,
                          int64_t rows, int64_t len, int keep, int group, int nthreads)
{
    return row_pass(fmt, NULL, x, rows, len, keep, group, nthreads, NULL, q_out, r_out);
}

/*
 * Q(x) of bfloat16 rows, nearest rounding, block-only scaling, written as bfloat16 (FP4
 * and FP8 values are exact in bf16): a bf16 engine's activation operand in one pass, the
 * same values as widening, fp4rl_quantize and narrowing.
 */
int fp4rl_quantize_bf16(int fmt, const uint16_t *x, uint16_t *y, int64_t rows, int64_t len,
                        int nthreads)
{
    return row_pass(fmt, NULL, x, rows, len, 0, 0, nthreads, NULL, y, NULL);
}

/*
 * A matrix's block values along its rows, along its columns, or both: the GEMM operands
 * of a linear layer (X or W along the reduction axis of the forward and along that of its
 * backward GEMM) written straight into the dtype the GEMM reads, with no float32 copy,
 * float32 output or cast pass between.
 *
 * Along the columns the matrix is cut into TILE x TILE tiles, each loaded once (float32,
 * or bfloat16 widened exactly) and divided by the per-tensor scale g (g == 0: none), its
 * rows the lanes kernel's blocks as they lie. Along the rows each row is read once and
 * its blocks go through the per-block functions. Both are the arithmetic every other path
 * runs; a block that crosses the matrix's edge is zero-padded, as everywhere else. Both
 * axes are two such passes: the tiles could serve the rows too (a transposed tile, or the
 * per-block functions on the tile's rows), but measured on AVX-512 and AVX2 either made
 * the pair slower than two passes, the extra read of the matrix costing less than the
 * tile's row work. The values are Q(x / g), not multiplied back by g (a GEMM operand keeps
 * g outside); written as float32, or as bfloat16, which holds every block value exactly
 * (NaN as the quiet NaN). Nearest rounding, the formats with a lanes kernel only (-1
 * otherwise: the caller composes other passes).
 */
enum { TILE = LANES };

/* w values of a row to y (float32, or bfloat16 bits), a loop the compiler vectorizes */
static inline void store_row(void *y, int64_t at, const float *v, int64_t w, int out_bf16)
{
    if (!out_bf16) {
        memcpy((float *)y + at, v, (size_t)w * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)y + at;
    for (int64_t c = 0; c < w; c++) out[c] = f32_to_bf16(v[c]);
}

/* One tile's blocks along its columns (n rows by w columns at x or xb, rows `cols` apart) */
static void cols_tile(int fmt, const float *x, const uint16_t *xb, int64_t cols, int n, int w,
                      float g, void *y, int out_bf16)
{
    const int bs = BLOCK[fmt];
    lanes_f buf[TILE], out[TILE];
    if (n < TILE || w < TILE) memset(buf, 0, sizeof(buf));
    for (int i = 0; i < n; i++) {
        if (xb)
            for (int c = 0; c < w; c++) buf[i][c] = bf16_to_f32(xb[i * cols + c]);
        else
            memcpy(buf[i], x + i * cols, (size_t)w * sizeof(float));
    }
    if (g != 0.0f)
        for (int i = 0; i < TILE; i++)
            for (int c = 0; c < TILE; c++) buf[i][c] = buf[i][c] / g;
    for (int r0 = 0; r0 < n; r0 += bs) lanes_quantize(fmt, buf + r0, out + r0, 1.0f);
    for (int i = 0; i < n; i++) store_row(y, i * cols, out[i], w, out_bf16);
}

/*
 * Along the rows alone: row by row, each read once where it lies (float32 without a scale)
 * or widened and divided into a row buffer, its blocks quantized by the per-block
 * functions into a second one, written out in the output dtype. Faster than the tiles
 * (no tile copy), and the same values.
 */
static int values_rows(int fmt, const float *x, const uint16_t *xb, int64_t rows,
                       int64_t cols, float g, void *y, int out_bf16, int nthreads,
                       int64_t done_rows)
{
    const int bs = BLOCK[fmt];
    int status = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = malloc((size_t)cols * 2 * sizeof(float));
        if (buf == NULL) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (buf == NULL) continue;
            /* HiF4's whole blocks go straight from x to y; the rest through the buffers */
            int64_t start = 0;
#ifdef HIF4_VECTOR
            if (fmt == FMT_HIF4 && g == 0.0f) {
                start = cols - cols % 64;  /* rows below done_rows: their whole blocks are */
                for (int64_t c0 = row < done_rows ? start : 0; c0 < start; c0 += 64 * 16) {
                    const int64_t nb = (start - c0) / 64;
                    hif4_blocks_v(x, xb, row * cols + c0, nb < 16 ? (int)nb : 16, y, out_bf16);
                }
            }
#endif
            const int64_t len = cols - start, at = row * cols + start;
            if (len == 0) continue;
            float *out = buf + len;
            const float *in = x ? x + at : buf;
            if (xb)
                for (int64_t c = 0; c < len; c++) buf[c] = bf16_to_f32(xb[at + c]);
            if (g != 0.0f) {
                for (int64_t c = 0; c < len; c++) buf[c] = in[c] / g;
                in = buf;
            }
            for (int64_t c0 = 0; c0 < len; c0 += bs)
                quantize_block(fmt, in + c0, out + c0, (int)(len - c0 < bs ? len - c0 : bs),
                               NULL, 0.0f);
            store_row(y, at, out, len, out_bf16);
        }
        free(buf);
    }
    return status;
}

/*
 * Ask the OS to back a fresh output buffer with huge pages (Linux transparent huge pages,
 * "madvise" mode, the common default): a weight's operand of tens of MB is otherwise
 * thousands of 4 KB page faults on its first write, which on a virtual machine take
 * about as long as a cast pass over it. Only the whole 2 MB pages inside the buffer;
 * advice only, so it changes no value and a refusal changes nothing.
 */
static void advise_huge(void *y, int64_t bytes)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    if (y == NULL || bytes < (int64_t)(4 * huge)) return;
    const uintptr_t start = ((uintptr_t)y + huge - 1) & ~(huge - 1);
    const uintptr_t end = ((uintptr_t)y + (uintptr_t)bytes) & ~(huge - 1);
    if (end > start) (void)madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)y;
    (void)bytes;
#endif
}

#ifdef HIF4_VECTOR
/*
 * HiF4 along both axes over the whole 64-row stripes and whole 64-column blocks, in chunks
 * of 64 rows by up to 1024 columns: the row blocks read a chunk from memory, the column
 * stripes read it again from cache, so the matrix is read once for both operands (a
 * weight's pair is bound by memory once the rounding runs 16 values a vector). Returns
 * the rows done (the columns done are cols - cols % 64).
 */
static int64_t hif4_both_v(const float *xf, const uint16_t *xb, int64_t rows, int64_t cols,
                           void *y_rows, void *y_cols, int out_bf16, int nthreads)
{
    const int64_t full_rows = rows - rows % 64, full_cols = cols - cols % 64;
    const int64_t across = (full_cols + 1023) / 1024;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < (full_rows / 64) * across; t++) {
        const int64_t row0 = (t / across) * 64, col0 = (t % across) * 1024;
        const int64_t width = full_cols - col0 < 1024 ? full_cols - col0 : 1024;
        for (int64_t i = row0; i < row0 + 64; i++)
            hif4_blocks_v(xf, xb, i * cols + col0, (int)(width / 64), y_rows, out_bf16);
        for (int64_t c = col0; c < col0 + width; c += 16)
            hif4_cols_v(xf, xb, row0 * cols + c, cols, y_cols, out_bf16);
    }
    return full_cols > 0 ? full_rows : 0;
}
#endif

int fp4rl_quantize_values(int fmt, const void *x, int x_bf16, int64_t rows, int64_t cols,
                          void *y_rows, void *y_cols, int out_bf16, float tensor_scale,
                          int nthreads)
{
    if (fmt < 0 || fmt > FMT_MXFP8) return -1;  /* the formats with a lanes kernel */
    const float *xf = x_bf16 ? NULL : (const float *)x;
    const uint16_t *xb = x_bf16 ? (const uint16_t *)x : NULL;
    const size_t size = out_bf16 ? 2 : 4;
    advise_huge(y_rows, rows * cols * (int64_t)size);
    advise_huge(y_cols, rows * cols * (int64_t)size);
    const int hif4 = fmt == FMT_HIF4 && tensor_scale == 0.0f;
    /* both axes of HiF4 in one read where there are whole stripes and blocks */
    int64_t both_rows = 0;
#ifdef HIF4_VECTOR
    if (hif4 && y_rows && y_cols)
        both_rows = hif4_both_v(xf, xb, rows, cols, y_rows, y_cols, out_bf16, nthreads);
#endif
    if (y_rows && values_rows(fmt, xf, xb, rows, cols, tensor_scale, y_rows, out_bf16,
                              nthreads, both_rows) != 0)
        return -2;
    if (y_cols == NULL) return 0;
    /* HiF4's whole 64 x 16 stripes go straight from x to y (from both_cols on where the
     * pass above did the rest); the tiles take the rest: the columns right of them, and
     * the rows below */
    int64_t full_rows = 0, full_cols = 0;
#ifdef HIF4_VECTOR
    if (hif4) {
        full_rows = rows - rows % 64;
        full_cols = cols - cols % 16;
        const int64_t both_cols = both_rows > 0 ? cols - cols % 64 : 0;
        const int64_t across = (full_cols - both_cols) / 16;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t t = 0; t < (full_rows / 64) * across; t++)
            hif4_cols_v(xf, xb, (t / across) * 64 * cols + both_cols + (t % across) * 16, cols,
                        y_cols, out_bf16);
    }
#else
    (void)hif4;
#endif
    const int64_t down = (rows + TILE - 1) / TILE, across = (cols + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < down * across; t++) {
        const int64_t row0 = (t / across) * TILE;
        int64_t col0 = (t % across) * TILE;
        if (row0 + TILE <= full_rows) {  /* the stripes did this tile up to full_cols */
            if (col0 + TILE <= full_cols) continue;
            col0 = col0 > full_cols ? col0 : full_cols;
        }
        const int64_t end = (t % across) * TILE + TILE;
        const int n = (int)(rows - row0 < TILE ? rows - row0 : TILE);
        const int w = (int)((cols < end ? cols : end) - col0);
        if (w <= 0) continue;
        const int64_t at = row0 * cols + col0;
        cols_tile(fmt, xf ? xf + at : NULL, xb ? xb + at : NULL, cols, n, w, tensor_scale,
                  (char *)y_cols + at * (int64_t)size, out_bf16);
    }
    return 0;
}
