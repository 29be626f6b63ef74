/* The vector helpers of the AVX2 variants (built with -march=x86-64-v3: AVX2 and FMA): 8
 * fp32 lanes, loads and stores of fp32 or bf16 elements, horizontal reductions, exp. */
#ifndef PD_VEC_AVX2_H
#define PD_VEC_AVX2_H

#include <immintrin.h>

#include "cpu_common.h"

typedef __m256 vfloat;

static inline vfloat vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vfloat vf_add(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
static inline vfloat vf_mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vf_max(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
/* a * b + c and c - a * b, each one rounding. */
static inline vfloat vf_fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline vfloat vf_fnmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vfloat vf_round(vfloat x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n for integral n with 2^n a normal float: 2^n built in the exponent bits. */
static inline vfloat vf_ldexp(vfloat p, vfloat n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

/* Elements i..i+7 of p (fp32, or bf16 widened exactly). */
PD_INLINE vfloat vf_load(const void* p, int64_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float*)p + i);
    const __m128i bits = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* Elements i..i+7 of p = v (to bf16 by f32_to_bf16). */
PD_INLINE void vf_store(void* p, int64_t i, vfloat v, const int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float*)p + i, v);
        return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int j = 0; j < 8; j++) ((uint16_t*)p)[i + j] = f32_to_bf16(lanes[j]);
}

static inline float vf_hsum(vfloat v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float vf_hmax(vfloat v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one vector, by a fixed tree. */
static inline vfloat vf_transpose_sum(const vfloat* a) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20),
                         _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* Lanes 0..n-1 all ones, the others zero. */
static inline vfloat vf_first_lanes(int n) {
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* Lanes lo..hi-1 all ones, the others zero. */
static inline vfloat vf_lanes(int lo, int hi) {
    return _mm256_andnot_ps(vf_first_lanes(lo), vf_first_lanes(hi));
}

#include "vec_exp.h"

#endif /* PD_VEC_AVX2_H */
