/* Paged attention for the CPU: decode attention that reads the paged KV cache in place,
 * and the KV cache write. Built and loaded by kernels/cpu_build.py (ctypes), one shared
 * object per machine; the torch-side signatures are in kernels/attention_cpu.py.
 *
 * Cache addressing, per layer: element (block, token, kv_head, d) is at
 *   block * blk_s + token * tok_s + kv_head * head_s + d          (d contiguous)
 * A token's slot is block * block_size + token. Block tables are int32, seq_lens int32.
 * T is float (fp32) or uint16_t (bf16 bits); arithmetic is always fp32.
 *
 * Decode: a task computes all G = H / Hkv query heads of a group: scores over the context
 * 16 tokens at a time, an exact softmax (max, exp, sum), then the probability-weighted sum
 * of V. With a batch of at least 4 sequences per thread, a task is one whole sequence
 * (every kv head, tile by tile, so that each block's head-major run is read in one pass);
 * with fewer, a task is one (sequence, kv head), so that the threads have work to share.
 * The AVX-512 paths are specialised for the common group sizes and head dims (so that q
 * and the accumulators stay in registers) and give equal results; on CPUs with AVX2 and
 * FMA but no AVX-512, head dims of 32, 64 and 128 take an 8-lane path, which also gives
 * equal results in both splits; other shapes and other CPUs take the portable loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

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

static inline float ld_f32(const float* p) { return *p; }
static inline float ld_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
static inline void st_f32(float* p, float v) { *p = v; }
static inline void st_bf16(uint16_t* p, float v) { *p = f32_to_bf16(v); }

/* The element offset of token t of a sequence (its block from the table, then its row). */
static inline int64_t token_at(const int32_t* table, int t, int block_size, int64_t blk_s,
                               int64_t tok_s) {
    return table[t / block_size] * blk_s + (int64_t)(t % block_size) * tok_s;
}

/* ---- KV cache write ------------------------------------------------------------------ */

#define DEFINE_WRITE(SFX, T)                                                                   \
    void pd_write_kv_##SFX(const T* k, const T* v, int64_t k_ts, int64_t k_hs, int64_t v_ts,  \
                           int64_t v_hs, T* kc, T* vc, int64_t blk_s, int64_t tok_s,          \
                           int64_t head_s, const int64_t* slots, int n, int hkv, int d,       \
                           int block_size) {                                                  \
        for (int i = 0; i < n; i++) {                                                         \
            const int64_t slot = slots[i];                                                    \
            if (slot < 0) continue; /* a padding row */                                       \
            const int64_t base = (slot / block_size) * blk_s + (slot % block_size) * tok_s;   \
            for (int h = 0; h < hkv; h++) {                                                   \
                memcpy(kc + base + h * head_s, k + i * k_ts + h * k_hs, sizeof(T) * d);       \
                memcpy(vc + base + h * head_s, v + i * v_ts + h * v_hs, sizeof(T) * d);       \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_WRITE(f32, float)
DEFINE_WRITE(bf16, uint16_t)

/* ---- decode attention: portable path --------------------------------------------------- */

#define DEFINE_DECODE_PORTABLE(SFX, T, LD, ST)                                                 \
    static void decode_task_portable_##SFX(                                                   \
        const T* q, int64_t q_ts, int64_t q_hs, const T* kc, const T* vc, int64_t blk_s,      \
        int64_t tok_s, int64_t head_s, const int32_t* table, int len, int s, int hk, int H,   \
        int G, int D, int block_size, float scale, T* out, float* scores, float* acc) {       \
        for (int g = 0; g < G; g++) {                                                         \
            const T* qp = q + s * q_ts + (int64_t)(hk * G + g) * q_hs;                        \
            float mx = -INFINITY;                                                             \
            for (int t = 0; t < len; t++) {                                                   \
                const T* kp = kc + table[t / block_size] * blk_s +                            \
                              (int64_t)(t % block_size) * tok_s + hk * head_s;                \
                float dot = 0.f;                                                              \
                for (int i = 0; i < D; i++) dot += LD(qp + i) * LD(kp + i);                   \
                dot *= scale;                                                                 \
                scores[t] = dot;                                                              \
                if (dot > mx) mx = dot;                                                       \
            }                                                                                 \
            float sum = 0.f;                                                                  \
            for (int t = 0; t < len; t++) {                                                   \
                scores[t] = expf(scores[t] - mx);                                             \
                sum += scores[t];                                                             \
            }                                                                                 \
            for (int i = 0; i < D; i++) acc[i] = 0.f;                                         \
            for (int t = 0; t < len; t++) {                                                   \
                const T* vp = vc + table[t / block_size] * blk_s +                            \
                              (int64_t)(t % block_size) * tok_s + hk * head_s;                \
                for (int i = 0; i < D; i++) acc[i] += scores[t] * LD(vp + i);                 \
            }                                                                                 \
            T* op = out + ((int64_t)s * H + hk * G + g) * D;                                  \
            for (int i = 0; i < D; i++) ST(op + i, acc[i] / sum);                             \
        }                                                                                     \
    }

DEFINE_DECODE_PORTABLE(f32, float, ld_f32, st_f32)
DEFINE_DECODE_PORTABLE(bf16, uint16_t, ld_bf16, st_bf16)

/* ---- decode attention: AVX2 path ---------------------------------------------------------- */

/* CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, older Intel). A task is one sequence's
 * kv heads hk0..hk1-1 (all of them, or one when there are too few sequences to share out).
 * Scores go 8 tokens at a time (8 partial dots, then one transposing sum for the 8), and
 * the V sums a block at a time; each tile's K (then V) rows of the task's heads are read
 * together, which in head-major blocks is one contiguous run per block (3 times longer
 * than a single head's, and read faster from memory). A head's arithmetic does not depend
 * on which other heads share its task, so a sequence gets equal results in either split:
 * the query scaled in fp32; each score one 8-lane chain over d, then a fixed tree over the
 * lanes; exp(score - max) in 8 lanes; the V sum over tokens in order; the division by the
 * sum of the exps last. D = 8 C with C 4, 8 or 16; block_size a multiple of 8. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define HAVE_AVX2 1
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
static inline void store8_f32(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8_bf16(uint16_t* p, __m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++) p[i] = f32_to_bf16(lanes[i]);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one vector. */
static inline __m256 transpose_sum8(const __m256* a) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* exp(x) for x <= 0: exp512's polynomial in 8 lanes, 2^n built in the exponent bits. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

/* Lanes 0..n-1 all ones, the others zero. */
static inline __m256 first_lanes(int n) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* work: 2 * nh * D + 8 * nh floats, 32-byte aligned (nh = (hk1 - hk0) * G); scores:
 * nh rows of stride_g floats. C is a constant at each call site. */
#define DEFINE_DECODE_SEQ_AVX2(SFX, T)                                                         \
    static inline __attribute__((always_inline)) void decode_seq_avx2_##SFX(                 \
        const T* q, int64_t q_ts, int64_t q_hs, const T* kc, const T* vc, int64_t blk_s,      \
        int64_t tok_s, int64_t head_s, const int32_t* table, int len, int s, int hk0,         \
        int hk1, int H, int G, const int C, int block_size, float scale, T* out,              \
        float* scores, int64_t stride_g, float* work) {                                       \
        const int nh = (hk1 - hk0) * G, D = 8 * C, h0 = hk0 * G;                              \
        float* qf = work;            /* [nh][D]: the scaled query */                          \
        float* accf = work + nh * D; /* [nh][D]: the V sums */                                \
        float* mxf = accf + nh * D;  /* [nh][8]: running maxima */                            \
        const __m256 scv = _mm256_set1_ps(scale);                                             \
        for (int i = 0; i < nh; i++) {                                                        \
            const T* qp = q + s * q_ts + (int64_t)(h0 + i) * q_hs;                            \
            for (int c = 0; c < C; c++) {                                                     \
                _mm256_store_ps(qf + i * D + 8 * c, _mm256_mul_ps(load8_##SFX(qp + 8 * c), scv)); \
                _mm256_store_ps(accf + i * D + 8 * c, _mm256_setzero_ps());                   \
            }                                                                                 \
            _mm256_store_ps(mxf + 8 * i, _mm256_set1_ps(-INFINITY));                          \
        }                                                                                     \
        const int nk = hk1 - hk0;                                                             \
        for (int t0 = 0; t0 < len; t0 += 8) {                                                 \
            const int tn = len - t0 < 8 ? len - t0 : 8;                                       \
            const T* kt = kc + token_at(table, t0, block_size, blk_s, tok_s) + hk0 * head_s;  \
            const __m256 valid = first_lanes(tn);                                             \
            for (int k = 0; k < nk; k++) {                                                    \
                const T* kb = kt + k * head_s;                                                \
                for (int g = 0; g < G; g++) {                                                 \
                    const int i = k * G + g;                                                  \
                    const float* qg = qf + i * D;                                             \
                    __m256 part[8];                                                           \
                    for (int j = 0; j < 8; j++) {                                             \
                        const T* kp = kb + (int64_t)(j < tn ? j : 0) * tok_s;                 \
                        __m256 x = _mm256_mul_ps(_mm256_load_ps(qg), load8_##SFX(kp));        \
                        for (int c = 1; c < C; c++)                                           \
                            x = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * c), load8_##SFX(kp + 8 * c), x); \
                        part[j] = x;                                                          \
                    }                                                                         \
                    const __m256 d = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),              \
                                                      transpose_sum8(part), valid);           \
                    _mm256_storeu_ps(scores + i * stride_g + t0, d);                          \
                    _mm256_store_ps(mxf + 8 * i, _mm256_max_ps(_mm256_load_ps(mxf + 8 * i), d)); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < nh; i++) {                                                        \
            const __m256 m = _mm256_set1_ps(hmax8(_mm256_load_ps(mxf + 8 * i)));              \
            float* p = scores + i * stride_g;                                                 \
            __m256 sum = _mm256_setzero_ps();                                                 \
            for (int t0 = 0; t0 < len; t0 += 8) {                                             \
                __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t0), m));                 \
                if (len - t0 < 8) e = _mm256_and_ps(e, first_lanes(len - t0));                \
                _mm256_storeu_ps(p + t0, e);                                                  \
                sum = _mm256_add_ps(sum, e);                                                  \
            }                                                                                 \
            mxf[8 * i] = hsum8(sum); /* the maxima are done with */                          \
        }                                                                                     \
        for (int t0 = 0; t0 < len; t0 += block_size) {                                        \
            const int tn = len - t0 < block_size ? len - t0 : block_size;                     \
            const T* vt = vc + token_at(table, t0, block_size, blk_s, tok_s) + hk0 * head_s;  \
            for (int k = 0; k < nk; k++) {                                                    \
                const T* vb = vt + k * head_s;                                                \
                for (int g = 0; g < G; g++) {                                                 \
                    const int i = k * G + g;                                                  \
                    const float* p = scores + i * stride_g + t0;                              \
                    for (int c0 = 0; c0 < C; c0 += 8) {                                       \
                        const int cn = C - c0 < 8 ? C - c0 : 8;                               \
                        __m256 acc[8];                                                        \
                        for (int c = 0; c < cn; c++) acc[c] = _mm256_load_ps(accf + i * D + 8 * (c0 + c)); \
                        for (int j = 0; j < tn; j++) {                                        \
                            const T* vp = vb + (int64_t)j * tok_s + 8 * c0;                   \
                            const __m256 pj = _mm256_set1_ps(p[j]);                           \
                            for (int c = 0; c < cn; c++)                                      \
                                acc[c] = _mm256_fmadd_ps(pj, load8_##SFX(vp + 8 * c), acc[c]); \
                        }                                                                     \
                        for (int c = 0; c < cn; c++) _mm256_store_ps(accf + i * D + 8 * (c0 + c), acc[c]); \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < nh; i++) {                                                        \
            T* op = out + ((int64_t)s * H + h0 + i) * D;                                      \
            const __m256 sv = _mm256_set1_ps(mxf[8 * i]);                                     \
            for (int c = 0; c < C; c++)                                                       \
                store8_##SFX(op + 8 * c, _mm256_div_ps(_mm256_load_ps(accf + i * D + 8 * c), sv)); \
        }                                                                                     \
    }                                                                                         \
    /* 1 when a specialised C took the task, else 0 (the portable loops run it). */          \
    static int decode_avx2_##SFX(const T* q, int64_t q_ts, int64_t q_hs, const T* kc,         \
                                 const T* vc, int64_t blk_s, int64_t tok_s, int64_t head_s,   \
                                 const int32_t* table, int len, int s, int hk0, int hk1,      \
                                 int H, int G, int D, int block_size, float scale, T* out,    \
                                 float* scores, int64_t stride_g, float* work) {              \
        if (block_size % 8) return 0;                                                         \
        switch (D) {                                                                          \
            case 64:                                                                          \
                decode_seq_avx2_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, \
                                      s, hk0, hk1, H, G, 8, block_size, scale, out, scores,   \
                                      stride_g, work);                                        \
                return 1;                                                                     \
            case 128:                                                                         \
                decode_seq_avx2_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, \
                                      s, hk0, hk1, H, G, 16, block_size, scale, out, scores,  \
                                      stride_g, work);                                        \
                return 1;                                                                     \
            case 32:                                                                          \
                decode_seq_avx2_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, \
                                      s, hk0, hk1, H, G, 4, block_size, scale, out, scores,   \
                                      stride_g, work);                                        \
                return 1;                                                                     \
        }                                                                                     \
        return 0;                                                                             \
    }

DEFINE_DECODE_SEQ_AVX2(f32, float)
DEFINE_DECODE_SEQ_AVX2(bf16, uint16_t)
#define AVX2_CALL(SFX, HK0, HK1)                                                               \
    decode_avx2_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, s, HK0, HK1, H, \
                      G, D, block_size, scale, out, scores, stride_g, work)
#else
#define HAVE_AVX2 0
#define AVX2_CALL(SFX, HK0, HK1) 0
#endif

/* ---- decode attention: AVX-512 path ------------------------------------------------------ */

#ifdef __AVX512F__
#define MAX_G 8
#define MAX_C 8 /* head_dim up to 128 */
/* M(SFX, G) for each group size the AVX-512 paths are specialised for. */
#define EACH_G(M, SFX) M(SFX, 1) M(SFX, 2) M(SFX, 3) M(SFX, 4) M(SFX, 5) M(SFX, 6) M(SFX, 7) M(SFX, 8)

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t* p) {
    const __m256i bits = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline void store16_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16_bf16(uint16_t* p, __m512 v) {
    /* round to nearest even, NaN kept quiet: as f32_to_bf16 */
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* exp(x) for the softmax (x <= 0), within 2 ulp: 2^n * p(r) with r = x - n ln 2. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Ask for the next 16 cache rows (each row_bytes long, rows tok_s elements apart) early:
 * a block's slab is a short stream on its own page, which the hardware prefetcher misses. */
static inline void prefetch_rows(const void* p, int64_t stride_bytes, int row_bytes) {
    const char* base = (const char*)p;
    for (int r = 0; r < 16; r++)
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(base + r * stride_bytes + b, _MM_HINT_T0);
}

/* prefetch_rows for each of hkv heads, head_bytes apart. */
static inline void prefetch_heads(const void* p, int hkv, int64_t head_bytes,
                                  int64_t stride_bytes, int row_bytes) {
    for (int hk = 0; hk < hkv; hk++)
        prefetch_rows((const char*)p + hk * head_bytes, stride_bytes, row_bytes);
}

/* [sum(a[0]), ..., sum(a[15])]: sixteen horizontal sums in one vector. */
static inline __m512 transpose_sum16(const __m512* a) {
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

/* One (sequence, kv head) task; G and C (= D / 16) are compile-time constants at every call
 * site, so q, the partial dots and the accumulators live in registers. block_size is a
 * multiple of 16, so each run of 16 tokens lies in one block. */
#define DEFINE_DECODE_AVX512(SFX, T)                                                           \
    static inline __attribute__((always_inline)) void decode_task_avx512_##SFX(              \
        const T* q, int64_t q_ts, int64_t q_hs, const T* kc, const T* vc, int64_t blk_s,      \
        int64_t tok_s, int64_t head_s, const int32_t* table, int len, int s, int hk, int H,   \
        const int G, const int C, int block_size, float scale, T* out, float* scores,         \
        int64_t stride_g) {                                                                   \
        __m512 qv[MAX_G][MAX_C], acc[MAX_G][MAX_C], mx[MAX_G];                                \
        const __m512 sc = _mm512_set1_ps(scale);                                              \
        for (int g = 0; g < G; g++) {                                                         \
            const T* qp = q + s * q_ts + (int64_t)(hk * G + g) * q_hs;                        \
            for (int c = 0; c < C; c++) qv[g][c] = _mm512_mul_ps(load16_##SFX(qp + 16 * c), sc); \
            mx[g] = _mm512_set1_ps(-INFINITY);                                                \
        }                                                                                     \
        for (int t0 = 0; t0 < len; t0 += 16) {                                                \
            const int tn = len - t0 < 16 ? len - t0 : 16;                                     \
            const T* kb = kc + table[t0 / block_size] * blk_s +                               \
                          (int64_t)(t0 % block_size) * tok_s + hk * head_s;                   \
            if (t0 + 16 < len) prefetch_rows(kc + table[(t0 + 16) / block_size] * blk_s +     \
                                             (int64_t)((t0 + 16) % block_size) * tok_s +      \
                                             hk * head_s, tok_s * (int64_t)sizeof(T), (int)sizeof(T) * 16 * C); \
            __m512 part[MAX_G][16];                                                           \
            for (int j = 0; j < 16; j++) {                                                    \
                const T* kp = kb + (int64_t)(j < tn ? j : 0) * tok_s;                         \
                __m512 kv[MAX_C];                                                             \
                for (int c = 0; c < C; c++) kv[c] = load16_##SFX(kp + 16 * c);                \
                for (int g = 0; g < G; g++) {                                                 \
                    __m512 x = _mm512_mul_ps(qv[g][0], kv[0]);                                \
                    for (int c = 1; c < C; c++) x = _mm512_fmadd_ps(qv[g][c], kv[c], x);      \
                    part[g][j] = x;                                                           \
                }                                                                             \
            }                                                                                 \
            const __mmask16 valid = (__mmask16)((1u << tn) - 1u);                             \
            for (int g = 0; g < G; g++) {                                                     \
                const __m512 d = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),       \
                                                      transpose_sum16(part[g]));              \
                _mm512_store_ps(scores + g * stride_g + t0, d);                               \
                mx[g] = _mm512_max_ps(mx[g], d);                                              \
            }                                                                                 \
        }                                                                                     \
        float inv[MAX_G];                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[g]));                     \
            float* p = scores + g * stride_g;                                                 \
            __m512 sum = _mm512_setzero_ps();                                                 \
            for (int t0 = 0; t0 < len; t0 += 16) {                                            \
                const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(p + t0), m));            \
                _mm512_store_ps(p + t0, e);                                                   \
                sum = _mm512_add_ps(sum, e);                                                  \
            }                                                                                 \
            inv[g] = 1.f / _mm512_reduce_add_ps(sum);                                         \
            for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();                      \
        }                                                                                     \
        for (int t0 = 0; t0 < len; t0 += 16) {                                                \
            const int tn = len - t0 < 16 ? len - t0 : 16;                                     \
            const T* vb = vc + table[t0 / block_size] * blk_s +                               \
                          (int64_t)(t0 % block_size) * tok_s + hk * head_s;                   \
            if (t0 + 16 < len) prefetch_rows(vc + table[(t0 + 16) / block_size] * blk_s +     \
                                             (int64_t)((t0 + 16) % block_size) * tok_s +      \
                                             hk * head_s, tok_s * (int64_t)sizeof(T), (int)sizeof(T) * 16 * C); \
            for (int j = 0; j < tn; j++) {                                                    \
                const T* vp = vb + (int64_t)j * tok_s;                                        \
                __m512 vv[MAX_C];                                                             \
                for (int c = 0; c < C; c++) vv[c] = load16_##SFX(vp + 16 * c);                \
                for (int g = 0; g < G; g++) {                                                 \
                    const __m512 pg = _mm512_set1_ps(scores[g * stride_g + t0 + j]);          \
                    for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            T* op = out + ((int64_t)s * H + hk * G + g) * 16 * C;                             \
            const __m512 iv = _mm512_set1_ps(inv[g]);                                         \
            for (int c = 0; c < C; c++) store16_##SFX(op + 16 * c, _mm512_mul_ps(acc[g][c], iv)); \
        }                                                                                     \
    }

DEFINE_DECODE_AVX512(f32, float)
DEFINE_DECODE_AVX512(bf16, uint16_t)


#define CASE_C(SFX, G_, C_)                                                                    \
    case C_:                                                                                  \
        decode_task_avx512_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, s,  \
                                 hk, H, G_, C_, block_size, scale, out, scores, stride_g);    \
        return 1;
#define CASE_G(SFX, G_)                                                                        \
    case G_:                                                                                  \
        switch (C) { CASE_C(SFX, G_, 2) CASE_C(SFX, G_, 4) CASE_C(SFX, G_, 8) }              \
        return 0;

#define DEFINE_DISPATCH(SFX, T)                                                                \
    static int decode_task_fast_##SFX(const T* q, int64_t q_ts, int64_t q_hs, const T* kc,     \
                                      const T* vc, int64_t blk_s, int64_t tok_s,               \
                                      int64_t head_s, const int32_t* table, int len, int s,    \
                                      int hk, int H, int G, int C, int block_size,             \
                                      float scale, T* out, float* scores, int64_t stride_g) {  \
        switch (G) {                                                                          \
            EACH_G(CASE_G, SFX)                                                               \
        }                                                                                     \
        return 0;                                                                             \
    }

DEFINE_DISPATCH(f32, float)
DEFINE_DISPATCH(bf16, uint16_t)

/* One sequence, every kv head, a 16-token tile at a time: each tile's K (then V) rows of all
 * heads are read together, which in the engine's head-major blocks is one contiguous run
 * per block, so the hardware prefetcher streams it. The arithmetic of each head is that of
 * decode_task_avx512, in the same order (the query scaled in fp32, the same dot-product
 * chains and sums, the V sum over tokens in order), so the two give equal results; only
 * the state between tiles (running maxima, V sums) lives in `work` instead of registers.
 * scores: [H][stride_g]; work: 2 * H * 16 * C + H * 16 floats, 64-byte aligned. */
#define DEFINE_DECODE_SEQ_AVX512(SFX, T)                                                       \
    static inline __attribute__((always_inline)) void decode_seq_avx512_##SFX(               \
        const T* q, int64_t q_ts, int64_t q_hs, const T* kc, const T* vc, int64_t blk_s,      \
        int64_t tok_s, int64_t head_s, const int32_t* table, int len, int s, int H, int hkv,  \
        const int G, const int C, int block_size, float scale, T* out, float* scores,         \
        int64_t stride_g, float* work) {                                                      \
        float* qf = work;                  /* [H][16 C]: the scaled query */                  \
        float* accf = work + H * 16 * C;   /* [H][16 C]: the V sums */                        \
        float* mxf = work + 2 * H * 16 * C; /* [H][16]: running maxima */                     \
        const __m512 sc = _mm512_set1_ps(scale);                                              \
        for (int h = 0; h < H; h++) {                                                         \
            const T* qp = q + s * q_ts + (int64_t)h * q_hs;                                   \
            for (int c = 0; c < C; c++)                                                       \
                _mm512_store_ps(qf + (h * C + c) * 16, _mm512_mul_ps(load16_##SFX(qp + 16 * c), sc)); \
            _mm512_store_ps(mxf + h * 16, _mm512_set1_ps(-INFINITY));                         \
        }                                                                                     \
        const int row_bytes = (int)sizeof(T) * 16 * C;                                        \
        for (int t0 = 0; t0 < len; t0 += 16) {                                                \
            const int tn = len - t0 < 16 ? len - t0 : 16;                                     \
            const __mmask16 valid = (__mmask16)((1u << tn) - 1u);                             \
            const T* kt = kc + token_at(table, t0, block_size, blk_s, tok_s);              \
            if (t0 + 16 < len)                                                                \
                prefetch_heads(kc + token_at(table, t0 + 16, block_size, blk_s, tok_s), hkv,   \
                               head_s * (int64_t)sizeof(T), tok_s * (int64_t)sizeof(T), row_bytes); \
            for (int hk = 0; hk < hkv; hk++) {                                                \
                const T* kb = kt + hk * head_s;                                               \
                for (int g = 0; g < G; g++) {                                                 \
                    const int h = hk * G + g;                                                 \
                    __m512 qv[MAX_C], part[16];                                               \
                    for (int c = 0; c < C; c++) qv[c] = _mm512_load_ps(qf + (h * C + c) * 16); \
                    for (int j = 0; j < 16; j++) {                                            \
                        const T* kp = kb + (int64_t)(j < tn ? j : 0) * tok_s;                 \
                        __m512 x = _mm512_mul_ps(qv[0], load16_##SFX(kp));                    \
                        for (int c = 1; c < C; c++)                                           \
                            x = _mm512_fmadd_ps(qv[c], load16_##SFX(kp + 16 * c), x);         \
                        part[j] = x;                                                          \
                    }                                                                         \
                    const __m512 d = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),   \
                                                          transpose_sum16(part));             \
                    _mm512_store_ps(scores + h * stride_g + t0, d);                           \
                    _mm512_store_ps(mxf + h * 16, _mm512_max_ps(_mm512_load_ps(mxf + h * 16), d)); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < H; h++) {                                                         \
            const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_load_ps(mxf + h * 16))); \
            float* p = scores + h * stride_g;                                                 \
            __m512 sum = _mm512_setzero_ps();                                                 \
            for (int t0 = 0; t0 < len; t0 += 16) {                                            \
                const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(p + t0), m));            \
                _mm512_store_ps(p + t0, e);                                                   \
                sum = _mm512_add_ps(sum, e);                                                  \
            }                                                                                 \
            mxf[h * 16] = 1.f / _mm512_reduce_add_ps(sum); /* the maxima are done with */    \
            for (int c = 0; c < C; c++) _mm512_store_ps(accf + (h * C + c) * 16, _mm512_setzero_ps()); \
        }                                                                                     \
        for (int t0 = 0; t0 < len; t0 += 16) {                                                \
            const int tn = len - t0 < 16 ? len - t0 : 16;                                     \
            const T* vt = vc + token_at(table, t0, block_size, blk_s, tok_s);              \
            if (t0 + 16 < len)                                                                \
                prefetch_heads(vc + token_at(table, t0 + 16, block_size, blk_s, tok_s), hkv,   \
                               head_s * (int64_t)sizeof(T), tok_s * (int64_t)sizeof(T), row_bytes); \
            for (int hk = 0; hk < hkv; hk++) {                                                \
                const T* vb = vt + hk * head_s;                                               \
                __m512 acc[MAX_G][MAX_C];                                                     \
                for (int g = 0; g < G; g++)                                                   \
                    for (int c = 0; c < C; c++)                                               \
                        acc[g][c] = _mm512_load_ps(accf + ((hk * G + g) * C + c) * 16);       \
                for (int j = 0; j < tn; j++) {                                                \
                    const T* vp = vb + (int64_t)j * tok_s;                                    \
                    __m512 vv[MAX_C];                                                         \
                    for (int c = 0; c < C; c++) vv[c] = load16_##SFX(vp + 16 * c);            \
                    for (int g = 0; g < G; g++) {                                             \
                        const __m512 pg = _mm512_set1_ps(scores[(hk * G + g) * stride_g + t0 + j]); \
                        for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]); \
                    }                                                                         \
                }                                                                             \
                for (int g = 0; g < G; g++)                                                   \
                    for (int c = 0; c < C; c++)                                               \
                        _mm512_store_ps(accf + ((hk * G + g) * C + c) * 16, acc[g][c]);       \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < H; h++) {                                                         \
            T* op = out + ((int64_t)s * H + h) * 16 * C;                                      \
            const __m512 iv = _mm512_set1_ps(mxf[h * 16]);                                    \
            for (int c = 0; c < C; c++)                                                       \
                store16_##SFX(op + 16 * c, _mm512_mul_ps(_mm512_load_ps(accf + (h * C + c) * 16), iv)); \
        }                                                                                     \
    }

DEFINE_DECODE_SEQ_AVX512(f32, float)
DEFINE_DECODE_SEQ_AVX512(bf16, uint16_t)

#define SEQ_CASE_C(SFX, G_, C_)                                                                \
    case C_:                                                                                  \
        decode_seq_avx512_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, s, H, \
                                hkv, G_, C_, block_size, scale, out, scores, stride_g, work); \
        return 1;
#define SEQ_CASE_G(SFX, G_)                                                                    \
    case G_:                                                                                  \
        switch (C) { SEQ_CASE_C(SFX, G_, 2) SEQ_CASE_C(SFX, G_, 4) SEQ_CASE_C(SFX, G_, 8) }  \
        return 0;
#define DEFINE_SEQ_DISPATCH(SFX, T)                                                            \
    static int decode_seq_fast_##SFX(const T* q, int64_t q_ts, int64_t q_hs, const T* kc,      \
                                     const T* vc, int64_t blk_s, int64_t tok_s, int64_t head_s, \
                                     const int32_t* table, int len, int s, int H, int hkv,     \
                                     int G, int C, int block_size, float scale, T* out,        \
                                     float* scores, int64_t stride_g, float* work) {           \
        switch (G) {                                                                          \
            EACH_G(SEQ_CASE_G, SFX)                                                           \
        }                                                                                     \
        return 0;                                                                             \
    }

DEFINE_SEQ_DISPATCH(f32, float)
DEFINE_SEQ_DISPATCH(bf16, uint16_t)
#define HAVE_FAST 1
#else
#define HAVE_FAST 0
#endif

/* ---- decode attention: entry points ------------------------------------------------------- */

/* q: [S, H, D] (strides q_ts, q_hs; d contiguous); out: [S, H, D] contiguous. */
#define DEFINE_DECODE(SFX, T)                                                                  \
    void pd_decode_attention_##SFX(const T* q, int64_t q_ts, int64_t q_hs, const T* kc,        \
                                   const T* vc, int64_t blk_s, int64_t tok_s, int64_t head_s,  \
                                   const int32_t* bt, int64_t bt_s, const int32_t* seq_lens,   \
                                   int S, int H, int hkv, int D, int block_size, float scale,  \
                                   T* out, int nthreads) {                                    \
        const int G = H / hkv, C = D / 16;                                                    \
        const int fast = HAVE_FAST && D % 16 == 0 && block_size % 16 == 0;                    \
        int max_len = 1;                                                                      \
        for (int s = 0; s < S; s++)                                                           \
            if (seq_lens[s] > max_len) max_len = seq_lens[s];                                 \
        const int64_t stride_g = ((int64_t)max_len + 31) & ~(int64_t)15;                      \
        /* With enough sequences to share out, a task is a whole sequence (SEQ_CALL or    \
         * AVX2_CALL over every kv head: its heads read block by block); else one task per  \
         * (sequence, kv head). */                                                          \
        const int avx2 = HAVE_AVX2 && block_size % 8 == 0 && (D == 32 || D == 64 || D == 128); \
        const int per_seq = S >= 4 * nthreads &&                                              \
                            ((fast && G <= 8 && (C == 2 || C == 4 || C == 8)) || avx2);       \
        const int ntasks = per_seq ? S : S * hkv;                                             \
        _Pragma("omp parallel num_threads(nthreads)") {                                       \
            const int rows = per_seq ? H : G;                                                 \
            float* scores = (float*)aligned_alloc(64, sizeof(float) * (size_t)(rows * stride_g)); \
            float* work = (float*)aligned_alloc(64, sizeof(float) * (size_t)(H * (2 * D + 16) + 16)); \
            float* acc = (float*)malloc(sizeof(float) * (size_t)D);                           \
            _Pragma("omp for schedule(dynamic)") for (int task = 0; task < ntasks; task++) {   \
                const int s = per_seq ? task : task / hkv, hk = per_seq ? 0 : task % hkv;     \
                const int len = seq_lens[s];                                                  \
                const int32_t* table = bt + (int64_t)s * bt_s;                                \
                if (len <= 0) continue;                                                       \
                if (per_seq) {                                                                \
                    if (fast) SEQ_CALL(SFX);                                                  \
                    else (void)AVX2_CALL(SFX, 0, hkv);                                        \
                } else if (!(fast && FAST_CALL(SFX)) && !(avx2 && AVX2_CALL(SFX, hk, hk + 1))) { \
                    decode_task_portable_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s,   \
                                               table, len, s, hk, H, G, D, block_size, scale, \
                                               out, scores, acc);                             \
                }                                                                             \
            }                                                                                 \
            free(acc);                                                                        \
            free(work);                                                                       \
            free(scores);                                                                     \
        }                                                                                     \
    }

#if HAVE_FAST
#define FAST_CALL(SFX)                                                                         \
    decode_task_fast_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, s, hk, H,  \
                           G, C, block_size, scale, out, scores, stride_g)
#define SEQ_CALL(SFX)                                                                          \
    decode_seq_fast_##SFX(q, q_ts, q_hs, kc, vc, blk_s, tok_s, head_s, table, len, s, H, hkv,  \
                          G, C, block_size, scale, out, scores, stride_g, work)
#else
#define FAST_CALL(SFX) 0
#define SEQ_CALL(SFX) ((void)0)
#endif

DEFINE_DECODE(f32, float)
DEFINE_DECODE(bf16, uint16_t)

/* The vector path this object was built for, so that Python can report it: 2 AVX-512,
 * 1 AVX2, 0 the portable loops. */
int pd_vector_path(void) { return HAVE_FAST ? 2 : HAVE_AVX2 ? 1 : 0; }
