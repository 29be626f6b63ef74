/* float32 linears on AVX2 CPUs: y[M, N] = x[M, K] @ W^T (+ bias), for every row count.
 * Built and loaded by kernels/cpu_build.py; the torch side is kernels/sgemm_cpu.py.
 *
 * On CPUs with AVX2 and FMA but no AVX-512, oneDNN's packed float32 linear reaches
 * 110-150 GFLOP/s on 2 threads at SmolLM2's decode and prefill shapes; a plain
 * register-blocked kernel reaches 145-186 (bench/sgemm_cpu.py). The weight is packed once
 * into panels of 16 columns ([N/16][K][16]); each thread takes a range of panels and, for
 * each, walks the rows 6 at a time: 6 x 16 accumulators (12 ymm registers), 2 weight
 * loads and 6 broadcasts per k. Every output is one fp32 sum over k in order, whatever M
 * or the thread count: a row's result does not depend on the batch it is in.
 * On CPUs with AVX-512, or without AVX2 and FMA, pd_sgemm_available() answers 0 and the
 * caller keeps oneDNN.
 */
#include <stddef.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

int pd_sgemm_available(void) { return 1; }

/* W [N, K] -> [N/16][K][16]: panel p holds columns 16p..16p+15, k-major. N % 16 == 0. */
void pd_sgemm_pack(const float* w, float* out, int N, int K) {
    for (int p = 0; p < N / 16; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < 16; j++)
                out[((size_t)p * K + k) * 16 + j] = w[(size_t)(p * 16 + j) * K + k];
}

/* Up to 6 rows of x (R of them real) against one 16-column panel. A block of fewer than 6
 * rows reads row 0 again in place of the missing ones and stores only its R rows: the
 * 6-row loop keeps its 12 accumulators in registers, and on these memory- and
 * load-bound shapes the wasted FMAs cost less than a narrower loop. */
static void rows_x_panel(const float* x, int R, int K, const float* panel, const float* bias,
                         float* y, int ldy) {
    const float* a[6];
    for (int r = 0; r < 6; r++) a[r] = x + (size_t)(r < R ? r : 0) * K;
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(panel + (size_t)k * 16);
        const __m256 b1 = _mm256_loadu_ps(panel + (size_t)k * 16 + 8);
        __m256 v;
        v = _mm256_broadcast_ss(a0 + k);
        c00 = _mm256_fmadd_ps(v, b0, c00), c01 = _mm256_fmadd_ps(v, b1, c01);
        v = _mm256_broadcast_ss(a1 + k);
        c10 = _mm256_fmadd_ps(v, b0, c10), c11 = _mm256_fmadd_ps(v, b1, c11);
        v = _mm256_broadcast_ss(a2 + k);
        c20 = _mm256_fmadd_ps(v, b0, c20), c21 = _mm256_fmadd_ps(v, b1, c21);
        v = _mm256_broadcast_ss(a3 + k);
        c30 = _mm256_fmadd_ps(v, b0, c30), c31 = _mm256_fmadd_ps(v, b1, c31);
        v = _mm256_broadcast_ss(a4 + k);
        c40 = _mm256_fmadd_ps(v, b0, c40), c41 = _mm256_fmadd_ps(v, b1, c41);
        v = _mm256_broadcast_ss(a5 + k);
        c50 = _mm256_fmadd_ps(v, b0, c50), c51 = _mm256_fmadd_ps(v, b1, c51);
    }
    const __m256 acc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    const __m256 zero = _mm256_setzero_ps();
    const __m256 bias0 = bias ? _mm256_loadu_ps(bias) : zero;
    const __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : zero;
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(y + (size_t)r * ldy, _mm256_add_ps(acc[2 * r], bias0));
        _mm256_storeu_ps(y + (size_t)r * ldy + 8, _mm256_add_ps(acc[2 * r + 1], bias1));
    }
}

static void panel_all_rows(const float* x, const float* panel, const float* bias, float* y,
                           int M, int N, int K) {
    for (int m = 0; m < M; m += 6)
        rows_x_panel(x + (size_t)m * K, M - m < 6 ? M - m : 6, K, panel, bias,
                     y + (size_t)m * N, N);
}

/* One row of x against panels [p0, p1) (at most 3): a decode step of one sequence is bound
 * by reading the weights, and one row's 2 accumulators per panel would leave the FMA
 * units waiting on their own latency; 3 panels give 6 independent chains. Each output is
 * still one sum over k in order, as in rows_x_panel. */
static void row_x_panels(const float* x, int K, const float* wp, const float* bias, float* y,
                         int p0, int p1) {
    const float* b[3];
    for (int i = 0; i < 3; i++) b[i] = wp + (size_t)(p0 + (p0 + i < p1 ? i : 0)) * K * 16;
    const float *b0 = b[0], *b1 = b[1], *b2 = b[2];
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    for (int k = 0; k < K; k++) {
        const __m256 v = _mm256_broadcast_ss(x + k);
        const size_t o = (size_t)k * 16;
        c00 = _mm256_fmadd_ps(v, _mm256_loadu_ps(b0 + o), c00);
        c01 = _mm256_fmadd_ps(v, _mm256_loadu_ps(b0 + o + 8), c01);
        c10 = _mm256_fmadd_ps(v, _mm256_loadu_ps(b1 + o), c10);
        c11 = _mm256_fmadd_ps(v, _mm256_loadu_ps(b1 + o + 8), c11);
        c20 = _mm256_fmadd_ps(v, _mm256_loadu_ps(b2 + o), c20);
        c21 = _mm256_fmadd_ps(v, _mm256_loadu_ps(b2 + o + 8), c21);
    }
    const __m256 acc[6] = {c00, c01, c10, c11, c20, c21};
    for (int i = 0; i < p1 - p0; i++) {
        const int n0 = (p0 + i) * 16;
        const __m256 zero = _mm256_setzero_ps();
        const __m256 bias0 = bias ? _mm256_loadu_ps(bias + n0) : zero;
        const __m256 bias1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : zero;
        _mm256_storeu_ps(y + n0, _mm256_add_ps(acc[2 * i], bias0));
        _mm256_storeu_ps(y + n0 + 8, _mm256_add_ps(acc[2 * i + 1], bias1));
    }
}

/* y[M, N] = x[M, K] @ W^T + bias (bias may be NULL); x and y contiguous; wp from
 * pd_sgemm_pack. Each of nthreads threads takes an even range of the N/16 panels. */
void pd_sgemm_linear(const float* x, const float* wp, const float* bias, float* y, int M, int N,
                     int K, int nthreads) {
    const int panels = N / 16;
    if (panels < 1 || M < 1) return;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > panels) nthreads = panels;
    if (M == 1) {
        const int groups = (panels + 2) / 3;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int g = 0; g < groups; g++)
            row_x_panels(x, K, wp, bias, y, 3 * g, 3 * g + 3 < panels ? 3 * g + 3 : panels);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int p = 0; p < panels; p++)
        panel_all_rows(x, wp + (size_t)p * K * 16, bias ? bias + p * 16 : NULL, y + p * 16, M, N,
                       K);
}

#else

int pd_sgemm_available(void) { return 0; }
void pd_sgemm_pack(const float* w, float* out, int N, int K) {
    (void)w, (void)out, (void)N, (void)K;
}
void pd_sgemm_linear(const float* x, const float* wp, const float* bias, float* y, int M, int N,
                     int K, int nthreads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)nthreads;
}

#endif
