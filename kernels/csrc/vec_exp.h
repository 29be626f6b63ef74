/* exp(x) for the softmax (x <= 0), within 2 ulp, in the lanes of the ISA header that
 * includes this one (vec_avx2.h, vec_avx512.h): 2^n p(r) with n = round(x / ln 2) and
 * r = x - n ln 2 (ln 2 in two parts), p a degree-7 polynomial. That header defines
 * vfloat and the vf_* operations used here; this is the one place the polynomial is written.
 */
#ifndef PD_VEC_EXP_H
#define PD_VEC_EXP_H

static inline vfloat vf_exp(vfloat x) {
    x = vf_max(x, vf_set1(-87.3f)); /* 2^n stays a normal float */
    const vfloat n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vfloat r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vfloat p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_ldexp(p, n);
}

#endif /* PD_VEC_EXP_H */
