/*
 * Batch-invariant CPU kernels: a GEMM, row softmax / log-softmax and a row mean whose
 * result for one output depends on that output's inputs alone, never on how many rows,
 * columns or batch entries are computed beside it, nor on the thread count.
 *
 * GEMM: out[i, j] = sum_k a[i, k] * b[k, j] (+ bias[j]), the products added one by one
 * in increasing k into a float32 accumulator that starts at +0, each step a fused
 * multiply-add (acc = fma(a, b, acc): the product and the sum rounded once, together), the
 * bias added last. With `chunk` > 0 the products of each run of `chunk` k's (from k = 0)
 * are summed so into a partial sum first, and the partial sums added in order into the
 * total: a fixed order set by K alone, with the rounding error of a sum of K / chunk terms.
 * Vectorization runs across the output columns j and register tiles across the rows i;
 * neither changes any output's sequence of operations. The fused multiply-add is the
 * hardware's on every x86-64 CPU with AVX2 (and AVX-512) and on every ARMv8 CPU, and C's
 * `fmaf` (correctly rounded in software) on an x86-64 build without it: IEEE 754 defines
 * its one rounding, so every build gives the same bits (tests/kernels/test_isa_builds.py
 * compares AVX-512, AVX2 and SSE2 builds). bf16 operands are widened exactly; a bf16
 * output is the accumulator rounded once, to nearest even. Threads split the (batch, row
 * block, column panel) triples: each output is computed whole by one thread.
 *
 * B is read through panels of NR columns by K, float32, zero-padded past N: packed per
 * call, or packed once by the caller (`fp4rl_bi_pack`) for a weight that stays the same
 * over many calls (a decode step re-reads every weight for a few rows). A is packed per
 * call into blocks of MR rows, k-major, so that the inner loop reads both operands in
 * order.
 *
 * A reduction over keys that are masked out adds exact zeros (a probability exp(-huge) is
 * +0), which leaves a sequential sum unchanged: attention's P V is then the same at any
 * left padding and for a query decoded alone against its cache.
 *
 * Row kernels: rows of `len` contiguous values; the max, then the exponentials' sum in
 * float64, sequentially. Row r's result depends on row r alone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* The register tile: MR rows by NR = 2 vectors of columns. It sets the speed alone:
 * every output's sequence of operations is the same at any tile, so the bits are too. */
#if defined(__AVX512F__)
typedef __m512 vec;
#define VW 16
#define MR 8 /* 16 accumulators of 32 */
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ZERO() _mm512_setzero_ps()
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define VW 8
#define MR 6 /* 12 accumulators of 16 */
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ZERO() _mm256_setzero_ps()
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm256_add_ps(a, b)
#else
typedef float vec;
#define VW 1
#define MR 4
#define V_LOAD(p) (*(p))
#define V_STORE(p, v) (*(p) = (v))
#define V_SET1(x) (x)
#define V_ZERO() 0.0f
#define V_FMA(a, b, c) fmaf(a, b, c)
#define V_ADD(a, b) ((a) + (b))
#endif
#define NR (2 * VW)
/* rows a task multiplies against its panel at a time: its packed A block stays in cache
 * while it is read once per panel */
#define MC (MR * 32)

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load(const void *p, int bf16, int64_t i)
{
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int bf16, int64_t i, float v)
{
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/*
 * bf16 operands on a CPU with AMX: the same runs of `chunk` k's (a multiple of 32), each
 * run's products summed by the tile unit's TDPBF16PS from a zeroed tile, the runs' sums
 * added in order in float32 as above. Within a run the tile unit sums each output's 32
 * products of a step in an order of its own (not IEEE's sequence of roundings, and with
 * denormals flushed to zero), the same for every row and column of every tile: an output
 * still depends on its own row and column alone, and K alone sets its sequence, so the
 * result is batch-invariant on this CPU; it is not the FMA path's bits. The choice is made
 * once per process (fp4rl_bi_amx), from the CPU and the kernel's permission.
 *
 * chunk < 0 asks for no runs: each output's K products in one sum, in the order the
 * hardware takes them fastest. On the tile unit the four tiles then accumulate every step
 * and are stored once, where runs of 64 cost a store and a float32 add of each tile per
 * two steps; elsewhere it is the one sequential sum of chunk 0. Still a function of the
 * output's row and column alone, but not the runs' bits: for a caller that promises no
 * fixed order (fp4rl.gemm.mm_fp32 outside the batch-invariant forward).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_ROWS 32 /* two A tiles of 16 rows */
#define AMX_COLS 32 /* two B tiles of 16 columns */
#define AMX_K 32    /* one tile step: 32 bf16 products per output */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Steps of 32 k's a packed A block or B panel holds: at least one (zeros where K = 0), so
 * that its size in fp4rl_bi_packed_floats and its reads in amx_gemm are the same. */
static inline int64_t amx_steps(int64_t K)
{
    return K > AMX_K ? (K + AMX_K - 1) / AMX_K : 1;
}

static int amx_state = -1; /* -1 not asked yet, 0 refused or turned off, 1 granted */

/* Turn the tile unit off (0) before any GEMM: the FMA path's bits on every CPU. */
void fp4rl_bi_allow_amx(int allowed)
{
    if (!allowed) amx_state = 0;
}

int fp4rl_bi_amx(void)
{
    if (amx_state < 0) {
        /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the kernel's permission to use tiles */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : 0;
    }
    return amx_state;
}

static void amx_configure(void)
{
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* Columns j0 .. j0 + 32 of b, k-pairs interleaved as the tile unit reads them: for each
 * step of 32 k's two 16-column tiles of 16 rows (k pairs) x 16 columns x 2, zeros past K
 * and N. Only bf16 b takes this layout. */
static void amx_pack_panel(const void *b, int64_t K, int64_t N, int64_t sb_k, int64_t sb_n,
                           int64_t j0, uint16_t *panel)
{
    const int64_t steps = amx_steps(K);
    for (int64_t s = 0; s < steps; s++)
        for (int half = 0; half < 2; half++) {
            uint16_t *tile = panel + (s * 2 + half) * 512;
            for (int pr = 0; pr < 16; pr++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t k = s * AMX_K + 2 * pr + e, j = j0 + half * 16 + c;
                        tile[(pr * 16 + c) * 2 + e] =
                            k < K && j < N ? ((const uint16_t *)b)[k * sb_k + j * sb_n] : 0;
                    }
        }
}

/* Rows i0 .. i0 + 32 of bf16 a: for each step of 32 k's two tiles of 16 rows x 32 k's,
 * zeros past M and K. A row whose k's lie contiguous (sa_k 1, the common case) moves 32
 * at a time, the tail of K masked; other strides go value by value. */
static void amx_pack_block(const void *a, int64_t M, int64_t K, int64_t sa_m, int64_t sa_k,
                           int64_t i0, uint16_t *block)
{
    const int64_t steps = amx_steps(K);
    const uint16_t *src = (const uint16_t *)a;
    for (int r = 0; r < AMX_ROWS; r++) {
        const int64_t i = i0 + r;
        uint16_t *dst = block + (r / 16) * 512 + (r % 16) * AMX_K;
        if (i >= M) {
            for (int64_t s = 0; s < steps; s++)
                _mm512_storeu_si512(dst + s * 1024, _mm512_setzero_si512());
        } else if (sa_k == 1) {
            for (int64_t s = 0; s < steps; s++) {
                const int64_t k = s * AMX_K, left = K - k;
                const __mmask32 m = left >= AMX_K ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
                _mm512_storeu_si512(dst + s * 1024,
                                    _mm512_maskz_loadu_epi16(m, src + i * sa_m + k));
            }
        } else {
            for (int64_t s = 0; s < steps; s++)
                for (int kk = 0; kk < AMX_K; kk++) {
                    const int64_t k = s * AMX_K + kk;
                    dst[s * 1024 + kk] = k < K ? src[i * sa_m + k * sa_k] : 0;
                }
        }
    }
}

/* One row of an output block: cols values of acc (+ bias) rounded to out's type, 16 at a
 * time; the bf16 rounding is f32_to_bf16's, lane by lane. */
static void amx_store_row(const float *acc, const float *bias, int cols, void *out,
                          int out_bf16, int64_t at)
{
    for (int c = 0; c < cols; c += 16) {
        const int n = cols - c < 16 ? cols - c : 16;
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        __m512 v = _mm512_loadu_ps(acc + c);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + c));
        if (!out_bf16) {
            _mm512_mask_storeu_ps((float *)out + at + c, m, v);
            continue;
        }
        const __m512i u = _mm512_castps_si512(v);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i h = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
        h = _mm512_mask_mov_epi32(
            h, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16((uint16_t *)out + at + c, m, _mm512_cvtepi32_epi16(h));
    }
}

/* One 32 x 32 output block: per run of `chunk` k's the four tiles zeroed, the run's steps
 * multiplied in, the tiles' sums added into acc in float32. `tall`: rows 16..31 exist. */
static void amx_block(const uint16_t *ablock, const uint16_t *panel, int64_t K,
                      int64_t chunk, int tall, float acc[AMX_ROWS][AMX_COLS])
{
    const int64_t steps = amx_steps(K), per_run = chunk > 0 ? chunk / AMX_K : steps;
    float part[AMX_ROWS][AMX_COLS];
    for (int r = 0; r < AMX_ROWS; r++)
        for (int c = 0; c < AMX_COLS; c += 16) _mm512_storeu_ps(&acc[r][c], _mm512_setzero_ps());
    for (int64_t s0 = 0; s0 < steps; s0 += per_run) {
        const int64_t s1 = steps - s0 < per_run ? steps : s0 + per_run;
        _tile_zero(0);
        _tile_zero(1);
        if (tall) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t s = s0; s < s1; s++) {
            _tile_loadd(4, ablock + (s * 2) * 512, 64);
            _tile_loadd(6, panel + (s * 2) * 512, 64);
            _tile_loadd(7, panel + (s * 2 + 1) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (tall) {
                _tile_loadd(5, ablock + (s * 2 + 1) * 512, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, &part[0][0], AMX_COLS * 4);
        _tile_stored(1, &part[0][16], AMX_COLS * 4);
        if (tall) {
            _tile_stored(2, &part[16][0], AMX_COLS * 4);
            _tile_stored(3, &part[16][16], AMX_COLS * 4);
        }
        for (int r = 0; r < (tall ? AMX_ROWS : 16); r++)
            for (int c = 0; c < AMX_COLS; c += 16)
                _mm512_storeu_ps(&acc[r][c], _mm512_add_ps(_mm512_loadu_ps(&acc[r][c]),
                                                           _mm512_loadu_ps(&part[r][c])));
    }
}

static int amx_gemm(int64_t M, int64_t N, int64_t K, const void *a, int64_t sa_m,
                    int64_t sa_k, const void *bm, int64_t sb_k, int64_t sb_n,
                    const float *bias, void *out, int out_bf16, int64_t so_m, int64_t chunk,
                    int threads, const uint16_t *packed)
{
    const int64_t S = amx_steps(K);
    const int64_t panels = (N + AMX_COLS - 1) / AMX_COLS;
    const int64_t blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    /* + 1: a buffer even for no rows or no columns */
    uint16_t *ablocks = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(blocks * S * 1024 + 1));
    uint16_t *bpanels =
        packed ? NULL : (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(panels * S * 1024 + 1));
    if (!ablocks || (!packed && !bpanels)) {
        free(ablocks);
        free(bpanels);
        return -1;
    }
    const uint16_t *bp = packed ? packed : bpanels;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t ib = 0; ib < blocks; ib++)
            amx_pack_block(a, M, K, sa_m, sa_k, ib * AMX_ROWS, ablocks + ib * S * 1024);
        if (!packed) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++)
                amx_pack_panel(bm, K, N, sb_k, sb_n, p * AMX_COLS, bpanels + p * S * 1024);
        }
        amx_configure();
        float acc[AMX_ROWS][AMX_COLS];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < blocks * panels; t++) {
            const int64_t ib = t / panels, p = t % panels;
            const int64_t i0 = ib * AMX_ROWS, j0 = p * AMX_COLS;
            const int rows = (int)(M - i0 < AMX_ROWS ? M - i0 : AMX_ROWS);
            const int cols = (int)(N - j0 < AMX_COLS ? N - j0 : AMX_COLS);
            amx_block(ablocks + ib * S * 1024, bp + p * S * 1024, K, chunk, rows > 16, acc);
            for (int r = 0; r < rows; r++)
                amx_store_row(acc[r], bias ? bias + j0 : NULL, cols, out, out_bf16,
                              (i0 + r) * so_m + j0);
        }
        _tile_release();
    }
    free(ablocks);
    free(bpanels);
    return 0;
}
#else
void fp4rl_bi_allow_amx(int allowed) { (void)allowed; }
int fp4rl_bi_amx(void) { return 0; }
#endif

/* Which kernel and packed-B layout a GEMM of these operands takes: 1, the tile unit's
 * (bf16 operands, runs a multiple of 32 k's or no runs, AMX granted); 0, the FMA tile's. */
int fp4rl_bi_layout(int a_bf16, int b_bf16, int64_t chunk)
{
#ifdef HAVE_AMX
    return a_bf16 && b_bf16 && (chunk < 0 || (chunk > 0 && chunk % AMX_K == 0)) &&
           fp4rl_bi_amx();
#else
    (void)a_bf16;
    (void)b_bf16;
    (void)chunk;
    return 0;
#endif
}

/* The float32 values a packed B of `layout` takes: the caller's buffer size. */
int64_t fp4rl_bi_packed_floats(int64_t K, int64_t N, int layout)
{
    const int64_t KK = K > 0 ? K : 1;
#ifdef HAVE_AMX
    if (layout == 1) {
        return ((N + AMX_COLS - 1) / AMX_COLS) * amx_steps(K) * 1024 / 2;
    }
#endif
    (void)layout;
    return ((N + NR - 1) / NR) * KK * NR;
}

/* Columns j0 .. j0 + NR of b (K x N, element strides sb_k, sb_n) into panel[k * NR + c],
 * zeros past N. Walks b along its unit stride. */
static void pack_panel(const void *b, int b_bf16, int64_t K, int64_t N, int64_t sb_k,
                       int64_t sb_n, int64_t j0, float *panel)
{
    const int cols = (int)(N - j0 < NR ? N - j0 : NR);
    if (cols < NR)
        for (int64_t k = 0; k < K; k++)
            for (int c = cols; c < NR; c++) panel[k * NR + c] = 0.0f;
    if (sb_k == 1 && sb_n != 1) {
        for (int c = 0; c < cols; c++)
            for (int64_t k = 0; k < K; k++)
                panel[k * NR + c] = load(b, b_bf16, (j0 + c) * sb_n + k);
    } else {
        for (int64_t k = 0; k < K; k++)
            for (int c = 0; c < cols; c++)
                panel[k * NR + c] = load(b, b_bf16, k * sb_k + (j0 + c) * sb_n);
    }
}

/* b (K x N, element strides) as ceil(N / NR) panels of K x NR float32: the layout
 * fp4rl_bi_gemm reads B in, for a caller that keeps it. */
int fp4rl_bi_pack(int64_t K, int64_t N, const void *b, int b_bf16, int64_t sb_k,
                  int64_t sb_n, float *panels, int threads, int layout)
{
#ifdef HAVE_AMX
    if (layout == 1) {
        if (!b_bf16) return -2;
        const int64_t S = amx_steps(K);
        const int64_t count = (N + AMX_COLS - 1) / AMX_COLS;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t p = 0; p < count; p++)
            amx_pack_panel(b, K, N, sb_k, sb_n, p * AMX_COLS, (uint16_t *)panels + p * S * 1024);
        return 0;
    }
#endif
    if (layout != 0) return -2;
    const int64_t count = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t p = 0; p < count; p++)
        pack_panel(b, b_bf16, K, N, sb_k, sb_n, p * NR, panels + p * K * NR);
    return 0;
}

/* Rows i0 .. i0 + MR of a (zeros past M) into block[k * MR + r]. */
static void pack_block(const void *a, int a_bf16, int64_t M, int64_t K, int64_t sa_m,
                       int64_t sa_k, int64_t i0, float *block)
{
    const int rows = (int)(M - i0 < MR ? M - i0 : MR);
    for (int r = 0; r < MR; r++) {
        if (r >= rows) {
            for (int64_t k = 0; k < K; k++) block[k * MR + r] = 0.0f;
            continue;
        }
        for (int64_t k = 0; k < K; k++)
            block[k * MR + r] = load(a, a_bf16, (i0 + r) * sa_m + k * sa_k);
    }
}

/* One `rows` x NR tile (rows <= MR, a constant where it is inlined): for each run
 * k0 .. k1 (of `step` k's), part = sum of fused products from +0, then acc += part
 * (chunked) or acc = part (one run). */
static inline __attribute__((always_inline)) void
tile(const float *block, const float *panel, int64_t K, int64_t step, int chunked, int rows,
     float acc[MR][NR])
{
    vec tot[MR][2];
    for (int r = 0; r < MR; r++) tot[r][0] = tot[r][1] = V_ZERO();
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t k1 = K - k0 < step ? K : k0 + step;
        vec part[MR][2];
        for (int r = 0; r < MR; r++) part[r][0] = part[r][1] = V_ZERO();
        for (int64_t k = k0; k < k1; k++) {
            const vec b0 = V_LOAD(panel + k * NR), b1 = V_LOAD(panel + k * NR + VW);
            const float *ak = block + k * MR;
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const vec av = V_SET1(ak[r]);
                part[r][0] = V_FMA(av, b0, part[r][0]);
                part[r][1] = V_FMA(av, b1, part[r][1]);
            }
        }
        for (int r = 0; r < rows; r++) {
            tot[r][0] = chunked ? V_ADD(tot[r][0], part[r][0]) : part[r][0];
            tot[r][1] = chunked ? V_ADD(tot[r][1], part[r][1]) : part[r][1];
        }
    }
    for (int r = 0; r < rows; r++) {
        V_STORE(acc[r], tot[r][0]);
        V_STORE(acc[r] + VW, tot[r][1]);
    }
}

/* The tile of `rows` rows, compiled for each row count. */
static void tile_rows(const float *block, const float *panel, int64_t K, int64_t step,
                      int chunked, int rows, float acc[MR][NR])
{
    switch (rows) {
#define ROWS(n) case n: tile(block, panel, K, step, chunked, n, acc); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if MR > 4
    ROWS(5) ROWS(6)
#endif
#if MR > 6
    ROWS(7) ROWS(8)
#endif
#undef ROWS
    default: break;
    }
}

/*
 * out[b] = a[b] @ bm[b] (+ bias) for b < batch. a: M x K (strides sa_b, sa_m, sa_k),
 * bm: K x N (strides sb_b, sb_k, sb_n), out: M x N (strides so_b, so_m, 1); element
 * strides. bias: N float32 values or NULL. *_bf16: the tensor holds bfloat16, else
 * float32. chunk: 0 (one sequential sum), the run of k's summed apart first, or < 0 (no
 * runs, the hardware's fastest order: see the tile unit's notes above). packed:
 * NULL, or bm (batch 1) already packed by fp4rl_bi_pack. Returns 0, or -1 where a buffer
 * cannot be allocated.
 */
int fp4rl_bi_gemm(int64_t batch, int64_t M, int64_t N, int64_t K,
                  const void *a, int a_bf16, int64_t sa_b, int64_t sa_m, int64_t sa_k,
                  const void *bm, int b_bf16, int64_t sb_b, int64_t sb_k, int64_t sb_n,
                  const float *bias, void *out, int out_bf16, int64_t so_b, int64_t so_m,
                  int64_t chunk, int threads, const float *packed)
{
#ifdef HAVE_AMX
    if (batch == 1 && fp4rl_bi_layout(a_bf16, b_bf16, chunk))
        return amx_gemm(M, N, K, a, sa_m, sa_k, bm, sb_k, sb_n, bias, out, out_bf16, so_m, chunk,
                        threads, (const uint16_t *)packed);
#endif
    const int64_t step = chunk > 0 ? chunk : (K > 0 ? K : 1);
    const int64_t KK = K > 0 ? K : 1;
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t blocks = (M + MR - 1) / MR;
    const int64_t row_blocks = (M + MC - 1) / MC;
    /* every panel packed once up front where several row blocks read it */
    const int shared_b = !packed && row_blocks > 1;
    float *ablocks = (float *)malloc(sizeof(float) * (size_t)(batch * blocks * KK * MR + 1));
    float *bpanels =
        shared_b ? (float *)malloc(sizeof(float) * (size_t)(batch * panels * KK * NR + 1)) : NULL;
    if (!ablocks || (shared_b && !bpanels)) {
        free(ablocks);
        free(bpanels);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < batch * blocks; t++) {
            const int64_t bi = t / blocks, ib = t % blocks;
            const char *ab = (const char *)a + (size_t)(bi * sa_b) * (a_bf16 ? 2 : 4);
            pack_block(ab, a_bf16, M, K, sa_m, sa_k, ib * MR, ablocks + t * KK * MR);
        }
        if (shared_b) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < batch * panels; t++) {
                const int64_t bi = t / panels, p = t % panels;
                const char *bb = (const char *)bm + (size_t)(bi * sb_b) * (b_bf16 ? 2 : 4);
                pack_panel(bb, b_bf16, K, N, sb_k, sb_n, p * NR, bpanels + t * KK * NR);
            }
        }
        float *own = (packed || shared_b) ? NULL : (float *)malloc(sizeof(float) * (size_t)KK * NR);
        if (!packed && !shared_b && !own) {
#pragma omp atomic write
            failed = 1;
        }
        float acc[MR][NR];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < batch * row_blocks * panels; t++) {
            if (!packed && !shared_b && !own) continue;
            const int64_t bi = t / (row_blocks * panels), rb = (t / panels) % row_blocks,
                          p = t % panels, j0 = p * NR;
            const int cols = (int)(N - j0 < NR ? N - j0 : NR);
            const float *panel;
            if (packed) {
                panel = packed + p * KK * NR;
            } else if (shared_b) {
                panel = bpanels + (bi * panels + p) * KK * NR;
            } else {
                const char *bb = (const char *)bm + (size_t)(bi * sb_b) * (b_bf16 ? 2 : 4);
                pack_panel(bb, b_bf16, K, N, sb_k, sb_n, j0, own);
                panel = own;
            }
            char *ob = (char *)out + (size_t)(bi * so_b) * (out_bf16 ? 2 : 4);
            const int64_t ib1 = (rb + 1) * (MC / MR) < blocks ? (rb + 1) * (MC / MR) : blocks;
            for (int64_t ib = rb * (MC / MR); ib < ib1; ib++) {
                const int64_t i0 = ib * MR;
                const int rows = (int)(M - i0 < MR ? M - i0 : MR);
                tile_rows(ablocks + (bi * blocks + ib) * KK * MR, panel, K, step, chunk > 0, rows, acc);
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < cols; c++) {
                        float v = acc[r][c];
                        if (bias) v = v + bias[j0 + c];
                        store(ob, out_bf16, (i0 + r) * so_m + j0 + c, v);
                    }
            }
        }
        free(own);
    }
    free(ablocks);
    free(bpanels);
    return failed ? -1 : 0;
}

/* Row r of `rows` x `len` values: its largest value, then sum exp(x - max) in float64,
 * one term after another. */
static double row_max(const void *x, int bf16, int64_t base, int64_t len)
{
    float m = -INFINITY;
    for (int64_t i = 0; i < len; i++) {
        const float v = load(x, bf16, base + i);
        if (v > m || isnan(v)) m = v;
        if (isnan(m)) break;
    }
    return m;
}

/*
 * Softmax (log_ = 0), log-softmax (log_ = 1) or log-sum-exp (log_ = 2: one value a row) of
 * each row, s = sum exp(x - max) in float64, then in float32: exp(x - max) / s, or
 * x - lse with lse = max + log(s). A log-prob taken as x - logsumexp(x) (TRL's) and one
 * taken from log_softmax(x) are then the same bits. A row of -inf gives NaN, as torch's.
 */
int fp4rl_bi_softmax(const void *x, int x_bf16, void *y, int y_bf16, int64_t rows,
                     int64_t len, int log_, int threads)
{
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * len;
        const float m = (float)row_max(x, x_bf16, base, len);
        double s = 0.0;
        for (int64_t i = 0; i < len; i++) s += (double)expf(load(x, x_bf16, base + i) - m);
        const float fs = (float)s, lse = m + logf(fs);
        if (log_ == 2) {
            store(y, y_bf16, r, lse);
            continue;
        }
        for (int64_t i = 0; i < len; i++) {
            const float v = load(x, x_bf16, base + i);
            store(y, y_bf16, base + i, log_ ? v - lse : expf(v - m) / fs);
        }
    }
    return 0;
}

/* The mean of each row, summed in float64 one value after another, rounded once. */
int fp4rl_bi_row_mean(const void *x, int x_bf16, void *y, int y_bf16, int64_t rows,
                      int64_t len, int threads)
{
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        double s = 0.0;
        for (int64_t i = 0; i < len; i++) s += (double)load(x, x_bf16, r * len + i);
        store(y, y_bf16, r, (float)(s / (double)len));
    }
    return 0;
}
