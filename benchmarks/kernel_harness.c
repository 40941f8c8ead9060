/*
 * Time the fused CPU quantization kernel alone: no Python, no allocation inside the
 * timed region (the output is preallocated and touched once), one thread.
 * Prints nanoseconds per value, best of 7, for every format along rows and along axis 0.
 *
 *   cc -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math \
 *      $(python -c 'from fp4rl.kernels.codes import c_defines; print(*c_defines())') \
 *      benchmarks/kernel_harness.c src/fp4rl/kernels/quant.c -lm -o /tmp/kernel_harness
 *   /tmp/kernel_harness [rows cols]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int fp4rl_quantize(int fmt, const float *x, float *y, int64_t rows, int64_t len,
                   const float *noise, int64_t noise_stride, float tensor_scale, int nthreads);
int fp4rl_quantize_cols(int fmt, const float *x, float *y, int64_t rows, int64_t cols,
                        const float *noise, int64_t noise_stride, float tensor_scale,
                        int nthreads);

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* Roughly normal values (sum of uniforms), so blocks have realistic spreads. */
static void fill(float *x, int64_t n)
{
    uint64_t s = 0x9E3779B97F4A7C15u;
    for (int64_t i = 0; i < n; i++) {
        double acc = 0.0;
        for (int k = 0; k < 4; k++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            acc += (double)(s >> 11) * 0x1p-53;
        }
        x[i] = (float)((acc - 2.0) * 1.7);
    }
}

int main(int argc, char **argv)
{
    const int64_t rows = argc > 2 ? atoll(argv[1]) : 2048, cols = argc > 2 ? atoll(argv[2]) : 2048;
    /* by code (FMT_* from the build's -D flags, fp4rl.kernels.codes) */
    const char *names[4];
    names[FMT_HIF4] = "hif4";
    names[FMT_MXFP4] = "mxfp4";
    names[FMT_NVFP4] = "nvfp4 (block scale only)";
    names[FMT_MXFP8] = "mxfp8_e4m3";
    float *x = malloc((size_t)(rows * cols) * sizeof(float));
    float *y = malloc((size_t)(rows * cols) * sizeof(float));
    if (x == NULL || y == NULL) return 1;
    fill(x, rows * cols);
    printf("%lld x %lld, ns per value (best of 7)\n", (long long)rows, (long long)cols);
    for (int fmt = 0; fmt < 4; fmt++)
        for (int axis = 1; axis >= 0; axis--) {
            double best = 1e30;
            for (int it = 0; it < 8; it++) {  /* the first run touches the output pages */
                const double t0 = now_ns();
                if (axis == 1)
                    fp4rl_quantize(fmt, x, y, rows, cols, NULL, 0, 0.0f, 1);
                else
                    fp4rl_quantize_cols(fmt, x, y, rows, cols, NULL, 0, 0.0f, 1);
                const double t = now_ns() - t0;
                if (it > 0 && t < best) best = t;
            }
            printf("%-26s axis %d: %.2f\n", names[fmt], axis, best / (double)(rows * cols));
        }
    free(x);
    free(y);
    return 0;
}
