/* float32 linears on AVX2 CPUs: y[M, N] = x[M, K] @ W^T (+ bias), for every row count.
 * Built and loaded by kernels/cpu_build.py; the torch side is kernels/sgemm_cpu.py, the
 * interface pdserve_kernels.h.
 *
 * On CPUs with AVX2 and FMA but no AVX-512, oneDNN's packed float32 linear reaches
 * 110-150 GFLOP/s on 2 threads at SmolLM2's decode and prefill shapes; a plain
 * register-blocked kernel reaches 145-186 (bench/kernels/sgemm_cpu.py). The weight is packed once
 * into panels of 16 columns ([N/16][K][16]); each thread takes a range of groups of 3
 * panels and, for each panel, walks the rows 6 at a time: 6 x 16 accumulators (12 ymm
 * registers), 2 weight loads and 6 broadcasts per k. The M % 6 rows left go 2 at a time
 * against the group's 3 panels (again 12 accumulators).
 *
 * Summation order: k goes in blocks of KB; each block is one fp32 chain in registers,
 * added in turn to the output's running total in y. One chain over the whole of k erred
 * 1.7-2.7x as far from a float64 product as MKL's sgemm (K = 576 and 1536), and that
 * reached the prompt logprobs that lm-eval compares with transformers (issue 36); blocks
 * of 64 bring it within MKL's (tests/unit/test_cpu_kernels.py). The order is the same in
 * both paths, whatever M or the thread count: a row's result does not depend on the batch
 * it is in.
 *
 * The kernel's one variant, avx2 (built with -march=x86-64-v3 on every machine): the
 * Python side uses it on CPUs with AVX2 and FMA but no AVX-512, and keeps oneDNN elsewhere.
 */
#include <immintrin.h>
#include <stddef.h>

#include "pdserve_kernels.h"

/* k per register chain (see the summation order above). */
enum { KB = 64 };

/* A block's 8 sums into the running totals at p: stored by the first block, added after. */
static inline void add_block(float* p, __m256 block, int first) {
    _mm256_storeu_ps(p, first ? block : _mm256_add_ps(_mm256_loadu_ps(p), block));
}

/* bias[0..16) added to a row's 16 totals at p. */
static inline void add_bias16(float* p, const float* bias) {
    _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(bias)));
    _mm256_storeu_ps(p + 8, _mm256_add_ps(_mm256_loadu_ps(p + 8), _mm256_loadu_ps(bias + 8)));
}

/* W [N, K] -> [N/16][K][16]: panel p holds columns 16p..16p+15, k-major. N % 16 == 0. */
void pd_sgemm_pack(const float* w, float* out, int N, int K) {
    for (int p = 0; p < N / 16; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < 16; j++)
                out[((size_t)p * K + k) * 16 + j] = w[(size_t)(p * 16 + j) * K + k];
}

/* 6 rows of x against one 16-column panel: 12 accumulators, 2 weight loads and 6
 * broadcasts per k. */
static void rows6_x_panel(const float* x, int K, const float* panel, const float* bias,
                          float* y, int ldy) {
    const float *a0 = x, *a1 = x + (size_t)K, *a2 = x + 2 * (size_t)K;
    const float *a3 = x + 3 * (size_t)K, *a4 = x + 4 * (size_t)K, *a5 = x + 5 * (size_t)K;
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K;
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        for (int k = k0; k < k1; k++) {
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
        for (int r = 0; r < 6; r++) {
            add_block(y + (size_t)r * ldy, acc[2 * r], k0 == 0);
            add_block(y + (size_t)r * ldy + 8, acc[2 * r + 1], k0 == 0);
        }
    }
    if (bias)
        for (int r = 0; r < 6; r++) add_bias16(y + (size_t)r * ldy, bias);
}

/* Up to 2 rows of x (R of them real) against panels [p0, p1) (at most 3): the rows that
 * do not fill a 6-row block. A 2 x 16 block would leave the FMA units waiting on their
 * own latency (4 accumulators); 2 rows x 3 panels keep 12 chains going, as the 6-row
 * block does. Each output is summed in rows6_x_panel's order. */
static void rows2_x_panels(const float* x, int R, int K, const float* wp, const float* bias,
                           float* y, int ldy, int p0, int p1) {
    const float* b[3];
    for (int i = 0; i < 3; i++) b[i] = wp + (size_t)(p0 + (p0 + i < p1 ? i : 0)) * K * 16;
    const float *b0 = b[0], *b1 = b[1], *b2 = b[2];
    const float *a0 = x, *a1 = x + (size_t)(R > 1 ? K : 0);
    for (int k0 = 0; k0 < K; k0 += KB) {
        const int k1 = k0 + KB < K ? k0 + KB : K;
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c04 = c00, c05 = c00;
        __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c14 = c00, c15 = c00;
        for (int k = k0; k < k1; k++) {
            const size_t o = (size_t)k * 16;
            const __m256 w0 = _mm256_loadu_ps(b0 + o), w1 = _mm256_loadu_ps(b0 + o + 8);
            const __m256 w2 = _mm256_loadu_ps(b1 + o), w3 = _mm256_loadu_ps(b1 + o + 8);
            const __m256 w4 = _mm256_loadu_ps(b2 + o), w5 = _mm256_loadu_ps(b2 + o + 8);
            const __m256 u = _mm256_broadcast_ss(a0 + k), v = _mm256_broadcast_ss(a1 + k);
            c00 = _mm256_fmadd_ps(u, w0, c00), c01 = _mm256_fmadd_ps(u, w1, c01);
            c02 = _mm256_fmadd_ps(u, w2, c02), c03 = _mm256_fmadd_ps(u, w3, c03);
            c04 = _mm256_fmadd_ps(u, w4, c04), c05 = _mm256_fmadd_ps(u, w5, c05);
            c10 = _mm256_fmadd_ps(v, w0, c10), c11 = _mm256_fmadd_ps(v, w1, c11);
            c12 = _mm256_fmadd_ps(v, w2, c12), c13 = _mm256_fmadd_ps(v, w3, c13);
            c14 = _mm256_fmadd_ps(v, w4, c14), c15 = _mm256_fmadd_ps(v, w5, c15);
        }
        const __m256 acc[2][6] = {{c00, c01, c02, c03, c04, c05}, {c10, c11, c12, c13, c14, c15}};
        for (int i = 0; i < p1 - p0; i++) {
            const int n0 = (p0 + i) * 16;
            for (int r = 0; r < R; r++) {
                add_block(y + (size_t)r * ldy + n0, acc[r][2 * i], k0 == 0);
                add_block(y + (size_t)r * ldy + n0 + 8, acc[r][2 * i + 1], k0 == 0);
            }
        }
    }
    if (bias)
        for (int i = 0; i < p1 - p0; i++)
            for (int r = 0; r < R; r++)
                add_bias16(y + (size_t)r * ldy + (p0 + i) * 16, bias + (p0 + i) * 16);
}

/* y[M, N] = x[M, K] @ W^T + bias (bias may be NULL); x and y contiguous; wp from
 * pd_sgemm_pack. The threads split the panels in groups of 3; in each group the rows go
 * 6 at a time through each panel, and the last M % 6 rows 2 at a time across the group
 * (a single sequence's decode step is such a tail: one row against 3 panels at once). */
void pd_sgemm_linear(const float* x, const float* wp, const float* bias, float* y, int M, int N,
                     int K, int nthreads) {
    const int panels = N / 16;
    if (panels < 1 || M < 1) return;
    const int groups = (panels + 2) / 3, full = M / 6 * 6;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > groups) nthreads = groups;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int g = 0; g < groups; g++) {
        const int p0 = 3 * g, p1 = p0 + 3 < panels ? p0 + 3 : panels;
        for (int p = p0; p < p1; p++)
            for (int m = 0; m < full; m += 6)
                rows6_x_panel(x + (size_t)m * K, K, wp + (size_t)p * K * 16,
                              bias ? bias + p * 16 : NULL, y + (size_t)m * N + p * 16, N);
        for (int m = full; m < M; m += 2)
            rows2_x_panels(x + (size_t)m * K, M - m < 2 ? 1 : 2, K, wp, bias, y + (size_t)m * N,
                           N, p0, p1);
    }
}
