/* Row argmax of fp32 logits for greedy sampling, as torch.argmax(x, dim=-1) answers it:
 * the first index of the largest value, and the first NaN's index in a row with a NaN.
 * Built and loaded by kernels/cpu_build.py; the torch side is kernels/sample_cpu.py.
 *
 * torch's CPU argmax over a [32, 49152] batch of logits runs at a few GB/s; this one reads
 * the rows at memory speed, one row per task over the threads, in 16 lanes (AVX-512) or 8
 * (AVX2). On CPUs with neither pd_argmax_available() answers 0 and the caller keeps
 * torch's.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>

int pd_argmax_available(void) { return 1; }

static int64_t first_nan(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(x[i])) return i;
    return -1;
}
#endif

#ifdef __AVX512F__

/* Each lane keeps its largest value and where it first saw it (a later equal value does
 * not replace it); the lanes' answer is the smallest index among those holding the max. */
static int64_t argmax_row(const float* x, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_set1_epi32(0), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                  10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, x + i);
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(tail, v, best, _CMP_GT_OQ);
        nan |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, idx);
    }
    if (nan) return first_nan(x, n);
    const float m = _mm512_reduce_max_ps(best);
    if (m == -INFINITY) return 0; /* every value is -inf: the first */
    const __mmask16 holds = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
    return _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), holds, at));
}
#elif defined(__AVX2__)
/* The AVX-512 row in 8 lanes; the tail of fewer than 8 values is read one at a time after
 * the lanes' answer, whose indices all come before it. */
static int64_t argmax_row(const float* x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        best = _mm256_blendv_ps(best, v, gt);
        at = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
        idx = _mm256_add_epi32(idx, step);
    }
    if (_mm256_movemask_ps(nan)) return first_nan(x, n);
    for (int64_t j = i; j < n; j++)
        if (isnan(x[j])) return j; /* no NaN before the tail */
    float lanes[8];
    int32_t where[8];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256((__m256i*)where, at);
    float m = -INFINITY;
    int64_t r = 0; /* every value -inf: the first (a lane holding -inf holds index 0) */
    for (int k = 0; k < 8; k++)
        if (lanes[k] > m || (lanes[k] == m && where[k] < r))
            m = lanes[k], r = where[k];
    for (; i < n; i++)
        if (x[i] > m) m = x[i], r = i;
    return r;
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
/* x: [rows, n] with row stride x_s (elements); out: [rows] int64. n < 2^31. */
void pd_argmax_f32(const float* x, int64_t x_s, int rows, int64_t n, int64_t* out,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * x_s, n);
}
#else
int pd_argmax_available(void) { return 0; }

void pd_argmax_f32(const float* x, int64_t x_s, int rows, int64_t n, int64_t* out,
                   int nthreads) {
    (void)x, (void)x_s, (void)rows, (void)n, (void)out, (void)nthreads;
}
#endif
