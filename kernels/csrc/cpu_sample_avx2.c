/* The AVX2 variant's row argmax: the AVX-512 row (cpu_sample_avx512.c) in 8 lanes; the
 * tail of fewer than 8 values is read one at a time after the lanes' answer, whose indices
 * all come before it. */
#include <immintrin.h>
#include <math.h>

#include "cpu_sample.h"

int64_t argmax_row(const float* x, int64_t n) {
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
