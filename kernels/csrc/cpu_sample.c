/* Row argmax of fp32 logits for greedy sampling, as torch.argmax(x, dim=-1) answers it:
 * the first index of the largest value, and the first NaN's index in a row with a NaN; and
 * structured outputs' token mask applied to logits in place.
 * Built and loaded by kernels/cpu_build.py; the torch side is kernels/sample_cpu.py, the
 * interface pdserve_kernels.h.
 *
 * torch's CPU argmax over a [32, 49152] batch of logits runs at a few GB/s; this one reads
 * the rows at memory speed, one row per task over the threads, in 16 lanes (the avx512
 * variant, cpu_sample_avx512.c) or 8 (avx2, cpu_sample_avx2.c). On CPUs with neither the
 * caller keeps torch's.
 */
#include <math.h>

#include "cpu_sample.h"
#include "pdserve_kernels.h"

int64_t first_nan(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(x[i])) return i;
    return -1;
}

/* x: [rows, n] with row stride x_s (elements); out: [rows] int64. n < 2^31. */
void pd_argmax_f32(const float* x, int64_t x_s, int rows, int64_t n, int64_t* out,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * x_s, n);
}

/* The mask word by word: a word of 32 allowed tokens (the common case inside a JSON string)
 * costs a compare; one of none a fill; the others a bit at a time. xgrammar's own CPU kernel
 * takes ~2 ms for 16 rows of 49,152 logits, a decode step's 5% on 2 cores. */
void pd_apply_bitmask_f32(float* x, int64_t x_s, const int32_t* mask, int64_t m_s,
                          const int64_t* rows, int nrows, int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nrows > 1)
    for (int k = 0; k < nrows; k++) {
        float* row = x + rows[k] * x_s;
        const uint32_t* bits = (const uint32_t*)(mask + rows[k] * m_s);
        for (int64_t w = 0; w * 32 < n; w++) {
            const uint32_t b = bits[w];
            if (b == 0xffffffffu) continue;
            const int64_t base = w * 32, end = base + 32 < n ? base + 32 : n;
            for (int64_t i = base; i < end; i++)
                if (!((b >> (i - base)) & 1u)) row[i] = -INFINITY;
        }
    }
}
