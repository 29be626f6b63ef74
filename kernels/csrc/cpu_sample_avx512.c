/* The AVX-512 variant's row argmax: 16 lanes, the tail under a mask. */
#include <immintrin.h>
#include <math.h>

#include "cpu_sample.h"

/* Each lane keeps its largest value and where it first saw it (a later equal value does
 * not replace it); the lanes' answer is the smallest index among those holding the max. */
int64_t argmax_row(const float* x, int64_t n) {
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
