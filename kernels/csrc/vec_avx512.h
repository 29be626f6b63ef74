/* The vector helpers of the AVX-512 variants (built with -march=x86-64-v4): 16 fp32 lanes,
 * loads and stores of fp32 or bf16 elements, horizontal reductions, exp. */
#ifndef PD_VEC_AVX512_H
#define PD_VEC_AVX512_H

#include <immintrin.h>

#include "cpu_common.h"

typedef __m512 vfloat;

static inline vfloat vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vfloat vf_add(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
static inline vfloat vf_mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vf_max(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
/* a * b + c and c - a * b, each one rounding. */
static inline vfloat vf_fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline vfloat vf_fnmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vfloat vf_round(vfloat x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* p * 2^n for integral n. */
static inline vfloat vf_ldexp(vfloat p, vfloat n) { return _mm512_scalef_ps(p, n); }

/* Elements i..i+15 of p (fp32, or bf16 widened exactly). */
PD_INLINE vfloat vf_load(const void* p, int64_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float*)p + i);
    const __m256i bits = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* Elements i..i+15 of p = v; to bf16 as f32_to_bf16 rounds (nearest even, NaN kept quiet). */
PD_INLINE void vf_store(void* p, int64_t i, vfloat v, const int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float*)p + i, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256((__m256i*)((uint16_t*)p + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

static inline float vf_hsum(vfloat v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vfloat v) { return _mm512_reduce_max_ps(v); }

/* [sum(a[0]), ..., sum(a[15])]: sixteen horizontal sums in one vector, by a fixed tree. */
static inline vfloat vf_transpose_sum(const vfloat* a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x88), _mm512_shuffle_f32x4(v, w, 0xDD));
}

#include "vec_exp.h"

#endif /* PD_VEC_AVX512_H */
