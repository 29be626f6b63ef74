/* Greedy sampling's row argmax inside one variant: cpu_sample.c (the rows over the threads,
 * the NaN rule) with one row kernel, cpu_sample_avx2.c or cpu_sample_avx512.c. */
#ifndef PD_CPU_SAMPLE_H
#define PD_CPU_SAMPLE_H

#include <stdint.h>

/* torch.argmax of one row of n fp32 values: the first index of the largest value, or of
 * the first NaN. */
int64_t argmax_row(const float* x, int64_t n);

/* The index of the first NaN of x[0..n), or -1. */
int64_t first_nan(const float* x, int64_t n);

#endif /* PD_CPU_SAMPLE_H */
