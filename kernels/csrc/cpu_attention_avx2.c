/* The AVX2 variant's decode (8 lanes; CPUs with AVX2 and FMA: AMD Zen 1-3, Intel since
 * Haswell). Head dims 32, 64 and 128 (D = 8 C, C a constant in each copy of the body),
 * block sizes a multiple of 8.
 *
 * A task is one sequence's kv heads hk0..hk1-1 (all of them, or one when there are too few
 * sequences to share out). Scores go 8 tokens at a time (8 partial dots, then one
 * transposing sum for the 8), and the V sums a block at a time; each tile's K (then V) rows
 * of the task's heads are read together, which in head-major blocks is one contiguous run
 * per block (3 times longer than a single head's, and read faster from memory). A head's
 * arithmetic does not depend on which other heads share its task, so a sequence gets equal
 * results in either split: the query scaled in fp32; each score one 8-lane chain over d,
 * then a fixed tree over the lanes; exp(score - max) in 8 lanes; the V sum over tokens in
 * order; the division by the sum of the exps last.
 *
 * A sliding window starts a sequence at its first_token t1: the score tiles at t1 rounded
 * down to 8 (still in t1's block; the lanes before t1 masked out of the scores), the V
 * sums at t1 itself. No block before t1's is read.
 */
#include "cpu_attention.h"
#include "vec_avx2.h"

/* work: [nh][D] the scaled query, [nh][D] the V sums, [nh][8] running maxima (nh = the
 * task's query heads); scores: nh rows of stride_g floats, token t at t - t_lo. */
PD_INLINE void decode_heads(const decode_call* call, int s, int hk0, int hk1, const int C,
                            const int bf16, float* scores, int64_t stride_g, float* work) {
    const void *q = call->q, *kc = call->kc, *vc = call->vc;
    void* out = call->out;
    const int64_t blk_s = call->blk_s, tok_s = call->tok_s, head_s = call->head_s;
    const int32_t* table = call->bt + (int64_t)s * call->bt_s;
    const int len = call->seq_lens[s], block_size = call->block_size;
    const int first = first_token(call, len), t_lo = first & ~7;
    const int H = call->H, G = H / call->hkv;
    const int nh = (hk1 - hk0) * G, D = 8 * C, h0 = hk0 * G;
    float* qf = work;
    float* accf = work + nh * D;
    float* mxf = accf + nh * D;
    const __m256 scv = _mm256_set1_ps(call->scale);
    for (int i = 0; i < nh; i++) {
        const void* qp = elem_at(q, s * call->q_ts + (int64_t)(h0 + i) * call->q_hs, bf16);
        for (int c = 0; c < C; c++) {
            _mm256_store_ps(qf + i * D + 8 * c, _mm256_mul_ps(vf_load(qp, 8 * c, bf16), scv));
            _mm256_store_ps(accf + i * D + 8 * c, _mm256_setzero_ps());
        }
        _mm256_store_ps(mxf + 8 * i, _mm256_set1_ps(-INFINITY));
    }
    const int nk = hk1 - hk0;
    for (int t0 = t_lo; t0 < len; t0 += 8) {
        const int tn = len - t0 < 8 ? len - t0 : 8, j0 = first > t0 ? first - t0 : 0;
        const int64_t tile = token_at(table, t0, block_size, blk_s, tok_s) + hk0 * head_s;
        const void* kt = elem_at(kc, tile, bf16);
        const __m256 valid = vf_lanes(j0, tn);
        for (int k = 0; k < nk; k++) {
            const void* kb = elem_at(kt, k * head_s, bf16);
            for (int g = 0; g < G; g++) {
                const int i = k * G + g;
                const float* qg = qf + i * D;
                __m256 part[8];
                for (int j = 0; j < 8; j++) {
                    const void* kp = elem_at(kb, (int64_t)(j < tn ? j : 0) * tok_s, bf16);
                    __m256 x = _mm256_mul_ps(_mm256_load_ps(qg), vf_load(kp, 0, bf16));
                    for (int c = 1; c < C; c++)
                        x = _mm256_fmadd_ps(_mm256_load_ps(qg + 8 * c), vf_load(kp, 8 * c, bf16),
                                            x);
                    part[j] = x;
                }
                const __m256 d =
                    _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), vf_transpose_sum(part), valid);
                _mm256_storeu_ps(scores + i * stride_g + (t0 - t_lo), d);
                _mm256_store_ps(mxf + 8 * i, _mm256_max_ps(_mm256_load_ps(mxf + 8 * i), d));
            }
        }
    }
    for (int i = 0; i < nh; i++) {
        const __m256 m = _mm256_set1_ps(vf_hmax(_mm256_load_ps(mxf + 8 * i)));
        float* p = scores + i * stride_g;
        __m256 sum = _mm256_setzero_ps();
        for (int t0 = t_lo; t0 < len; t0 += 8) {
            __m256 e = vf_exp(_mm256_sub_ps(_mm256_loadu_ps(p + (t0 - t_lo)), m));
            if (t0 < first || len - t0 < 8) {
                const int lo = t0 < first ? first - t0 : 0, hi = len - t0 < 8 ? len - t0 : 8;
                e = _mm256_and_ps(e, vf_lanes(lo, hi));
            }
            _mm256_storeu_ps(p + (t0 - t_lo), e);
            sum = _mm256_add_ps(sum, e);
        }
        mxf[8 * i] = vf_hsum(sum); /* the maxima are done with */
    }
    /* A block at a time, from the first token (wherever it lies in its block). */
    for (int t0 = first; t0 < len; t0 += block_size - t0 % block_size) {
        const int t_end = t0 - t0 % block_size + block_size;
        const int tn = (len < t_end ? len : t_end) - t0;
        const int64_t tile = token_at(table, t0, block_size, blk_s, tok_s) + hk0 * head_s;
        const void* vt = elem_at(vc, tile, bf16);
        for (int k = 0; k < nk; k++) {
            const void* vb = elem_at(vt, k * head_s, bf16);
            for (int g = 0; g < G; g++) {
                const int i = k * G + g;
                const float* p = scores + i * stride_g + (t0 - t_lo);
                for (int c0 = 0; c0 < C; c0 += 8) {
                    const int cn = C - c0 < 8 ? C - c0 : 8;
                    __m256 acc[8];
                    for (int c = 0; c < cn; c++)
                        acc[c] = _mm256_load_ps(accf + i * D + 8 * (c0 + c));
                    for (int j = 0; j < tn; j++) {
                        const void* vp = elem_at(vb, (int64_t)j * tok_s + 8 * c0, bf16);
                        const __m256 pj = _mm256_set1_ps(p[j]);
                        for (int c = 0; c < cn; c++)
                            acc[c] = _mm256_fmadd_ps(pj, vf_load(vp, 8 * c, bf16), acc[c]);
                    }
                    for (int c = 0; c < cn; c++)
                        _mm256_store_ps(accf + i * D + 8 * (c0 + c), acc[c]);
                }
            }
        }
    }
    for (int i = 0; i < nh; i++) {
        void* op = (char*)out + ((int64_t)s * H + h0 + i) * D * elem_size(bf16);
        const __m256 sv = _mm256_set1_ps(mxf[8 * i]);
        for (int c = 0; c < C; c++)
            vf_store(op, 8 * c, _mm256_div_ps(_mm256_load_ps(accf + i * D + 8 * c), sv), bf16);
    }
}

/* decode_heads with C a constant for each head dim taken. */
PD_INLINE void decode_heads_of_dim(const decode_call* call, int s, int hk0, int hk1,
                                   const int bf16, float* scores, int64_t stride_g, float* work) {
    switch (call->D) {
        case 32: decode_heads(call, s, hk0, hk1, 4, bf16, scores, stride_g, work); return;
        case 64: decode_heads(call, s, hk0, hk1, 8, bf16, scores, stride_g, work); return;
        case 128: decode_heads(call, s, hk0, hk1, 16, bf16, scores, stride_g, work); return;
    }
}

static void decode_heads_f32(const decode_call* call, int s, int hk0, int hk1, float* scores,
                             int64_t stride_g, float* work) {
    decode_heads_of_dim(call, s, hk0, hk1, 0, scores, stride_g, work);
}

static void decode_heads_bf16(const decode_call* call, int s, int hk0, int hk1, float* scores,
                              int64_t stride_g, float* work) {
    decode_heads_of_dim(call, s, hk0, hk1, 1, scores, stride_g, work);
}

int vec_decode_takes(int G, int D, int block_size) {
    (void)G;
    return block_size % 8 == 0 && (D == 32 || D == 64 || D == 128);
}

void vec_decode_sequence(const decode_call* call, int s, float* scores, int64_t stride_g,
                         float* work) {
    if (call->bf16)
        decode_heads_bf16(call, s, 0, call->hkv, scores, stride_g, work);
    else
        decode_heads_f32(call, s, 0, call->hkv, scores, stride_g, work);
}

void vec_decode_head(const decode_call* call, int s, int hk, float* scores, int64_t stride_g,
                     float* work) {
    if (call->bf16)
        decode_heads_bf16(call, s, hk, hk + 1, scores, stride_g, work);
    else
        decode_heads_f32(call, s, hk, hk + 1, scores, stride_g, work);
}
