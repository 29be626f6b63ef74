/* Scalar helpers of every kernel variant: bf16 bits to and from fp32 (as torch rounds), and
 * elements of a tensor that is fp32 or bf16.
 *
 * A kernel body is written once for both element types: it takes `bf16` (1: uint16_t bf16
 * bits, 0: float) as an argument that is a constant at each specialised call site, so that
 * after inlining the compiler keeps only that type's loads and stores.
 */
#ifndef PD_CPU_COMMON_H
#define PD_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

/* For a body whose constant arguments (element type, group size, head dim) must reach its
 * loops: each call site gets its own copy. */
#define PD_INLINE static inline __attribute__((always_inline))

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* Bytes per element. */
PD_INLINE int elem_size(const int bf16) { return bf16 ? 2 : 4; }

/* &p[i] for elements of either type. */
PD_INLINE const void* elem_at(const void* p, int64_t i, const int bf16) {
    return (const char*)p + i * elem_size(bf16);
}

/* Element i of p, as fp32. */
PD_INLINE float load_elem(const void* p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

/* Element i of p = v (rounded to bf16 where p holds bf16). */
PD_INLINE void store_elem(void* p, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t*)p)[i] = f32_to_bf16(v);
    else
        ((float*)p)[i] = v;
}

#endif /* PD_CPU_COMMON_H */
