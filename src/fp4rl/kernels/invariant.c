/*
 * Batch-invariant CPU kernels: a GEMM, row softmax / log-softmax and a row mean whose
 * result for one output depends on that output's inputs alone, never on how many rows,
 * columns or batch entries are computed beside it, nor on the thread count or the CPU.
 *
 * GEMM: out[i, j] = sum_k a[i, k] * b[k, j] (+ bias[j]), the products added one by one
 * in increasing k into a float32 accumulator that starts at +0, each product and each sum
 * rounded on its own (the build turns contraction into FMA off), the bias added last.
 * With `chunk` > 0 the products of each run of `chunk` k's (from k = 0) are summed so
 * into a partial sum first, and the partial sums added in order into the total: a fixed
 * order set by K alone, with the rounding error of a sum of K / chunk terms.
 * Vectorization runs across the output columns j and register tiles across the rows i;
 * neither changes any output's sequence of operations. bf16 operands are widened exactly;
 * a bf16 output is the accumulator rounded once, to nearest even. Threads split the
 * (batch, column panel) pairs: each output is computed whole by one thread.
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

/* The register tile: NR columns (vectorized) by MR rows. It sets the speed alone: every
 * output's sequence of operations is the same at any tile, so the bits are too. */
#if defined(__AVX512F__)
#define NR 32 /* two AVX-512 vectors a row, four rows: 8 accumulators */
#define MR 4
#else
#define NR 16 /* two AVX2 vectors a row, six rows: 12 accumulators */
#define MR 6
#endif

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

/* Rows i0 .. i0 + MR of one column panel, k from k0 to k1: the fixed-size tile the
 * compiler keeps in registers, added into `part` (zeroed first). */
static void tile_full(const void *a, int a_bf16, int64_t sa_m, int64_t sa_k, int64_t i0,
                      const float *panel, int64_t k0, int64_t k1, float part[MR][NR])
{
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) part[r][c] = 0.0f;
    for (int64_t k = k0; k < k1; k++) {
        const float *bk = panel + k * NR;
        for (int r = 0; r < MR; r++) {
            const float av = load(a, a_bf16, (i0 + r) * sa_m + k * sa_k);
            for (int c = 0; c < NR; c++) part[r][c] = part[r][c] + av * bk[c];
        }
    }
}

/* The last rows of a panel, fewer than MR: the same sequence of operations per output. */
static void tile_rows(const void *a, int a_bf16, int64_t sa_m, int64_t sa_k, int64_t i0,
                      int rows, const float *panel, int64_t k0, int64_t k1,
                      float part[MR][NR])
{
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < NR; c++) part[r][c] = 0.0f;
        for (int64_t k = k0; k < k1; k++) {
            const float av = load(a, a_bf16, (i0 + r) * sa_m + k * sa_k);
            const float *bk = panel + k * NR;
            for (int c = 0; c < NR; c++) part[r][c] = part[r][c] + av * bk[c];
        }
    }
}

/*
 * out[b] = a[b] @ bm[b] (+ bias) for b < batch. a: M x K (strides sa_b, sa_m, sa_k),
 * bm: K x N (strides sb_b, sb_k, sb_n), out: M x N (strides so_b, so_m, 1); element
 * strides. bias: N float32 values or NULL. *_bf16: the tensor holds bfloat16, else
 * float32. chunk: 0 (one sequential sum) or the run of k's summed apart first. Returns 0,
 * or -1 where a panel buffer cannot be allocated.
 */
int fp4rl_bi_gemm(int64_t batch, int64_t M, int64_t N, int64_t K,
                  const void *a, int a_bf16, int64_t sa_b, int64_t sa_m, int64_t sa_k,
                  const void *bm, int b_bf16, int64_t sb_b, int64_t sb_k, int64_t sb_n,
                  const float *bias, void *out, int out_bf16, int64_t so_b, int64_t so_m,
                  int64_t chunk, int threads)
{
    const int64_t step = chunk > 0 ? chunk : (K > 0 ? K : 1);
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t tasks = batch * panels;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *panel = (float *)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1) * NR);
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (!panel) continue;
            const int64_t bi = t / panels, j0 = (t % panels) * NR;
            const int cols = (int)(N - j0 < NR ? N - j0 : NR);
            const char *ab = (const char *)a + (size_t)(bi * sa_b) * (a_bf16 ? 2 : 4);
            const char *bb = (const char *)bm + (size_t)(bi * sb_b) * (b_bf16 ? 2 : 4);
            char *ob = (char *)out + (size_t)(bi * so_b) * (out_bf16 ? 2 : 4);
            for (int64_t k = 0; k < K; k++)
                for (int c = 0; c < NR; c++)
                    panel[k * NR + c] = c < cols ? load(bb, b_bf16, k * sb_k + (j0 + c) * sb_n)
                                                 : 0.0f;
            float acc[MR][NR], part[MR][NR];
            for (int64_t i0 = 0; i0 < M; i0 += MR) {
                const int rows = (int)(M - i0 < MR ? M - i0 : MR);
                for (int r = 0; r < MR; r++)
                    for (int c = 0; c < NR; c++) acc[r][c] = 0.0f;
                for (int64_t k0 = 0; k0 < K; k0 += step) {
                    const int64_t k1 = K - k0 < step ? K : k0 + step;
                    if (rows == MR) tile_full(ab, a_bf16, sa_m, sa_k, i0, panel, k0, k1, part);
                    else tile_rows(ab, a_bf16, sa_m, sa_k, i0, rows, panel, k0, k1, part);
                    if (chunk > 0) {
                        for (int r = 0; r < rows; r++)
                            for (int c = 0; c < NR; c++) acc[r][c] = acc[r][c] + part[r][c];
                    } else {
                        memcpy(acc, part, sizeof(acc));
                    }
                }
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < cols; c++) {
                        float v = acc[r][c];
                        if (bias) v = v + bias[j0 + c];
                        store(ob, out_bf16, (i0 + r) * so_m + j0 + c, v);
                    }
            }
        }
        free(panel);
    }
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
