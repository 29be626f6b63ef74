/* Paged attention for the CPU: the KV cache write, and decode attention that reads the
 * paged cache in place. Loaded by kernels/attention_cpu.py (ctypes) and called by
 * torch_ops.cpp; the interface is pdserve_kernels.h. This file is in every variant: the
 * task split, the write and the portable loops, built with the variant's flags beside its
 * vector decoder (cpu_attention.h).
 *
 * Decode: a task computes all G = H / hkv query heads of a group: scores over the context,
 * an exact softmax (max, exp, sum), then the probability-weighted sum of V; arithmetic is
 * always fp32. With a batch of at least 4 sequences per thread and a shape the vector
 * decoder takes, a task is one whole sequence (every kv head, so that each block's
 * head-major run is read in one pass); otherwise a task is one (sequence, kv head), so
 * that the threads have work to share, and shapes the decoder does not take run the
 * portable loops below.
 *
 * A sliding window (window > 0) starts each sequence at its first_token (cpu_attention.h):
 * the loops begin at that token of its block, so the blocks before are never read.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attention.h"
#include "pdserve_kernels.h"

/* ---- KV cache write -------------------------------------------------------------------- */

PD_INLINE void write_kv(const void* k, const void* v, int64_t k_ts, int64_t k_hs, int64_t v_ts,
                        int64_t v_hs, void* kc, void* vc, int64_t blk_s, int64_t tok_s,
                        int64_t head_s, const int64_t* slots, int n, int hkv, int d,
                        int block_size, const int bf16) {
    const int64_t es = elem_size(bf16);
    for (int i = 0; i < n; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue; /* a padding row */
        const int64_t base = (slot / block_size) * blk_s + (slot % block_size) * tok_s;
        for (int h = 0; h < hkv; h++) {
            const int64_t at = es * (base + h * head_s);
            memcpy((char*)kc + at, (const char*)k + es * (i * k_ts + h * k_hs), es * d);
            memcpy((char*)vc + at, (const char*)v + es * (i * v_ts + h * v_hs), es * d);
        }
    }
}

void pd_write_kv_f32(const float* k, const float* v, int64_t k_ts, int64_t k_hs, int64_t v_ts,
                     int64_t v_hs, float* kc, float* vc, int64_t blk_s, int64_t tok_s,
                     int64_t head_s, const int64_t* slots, int n, int hkv, int d, int block_size) {
    write_kv(k, v, k_ts, k_hs, v_ts, v_hs, kc, vc, blk_s, tok_s, head_s, slots, n, hkv, d,
             block_size, 0);
}

void pd_write_kv_bf16(const uint16_t* k, const uint16_t* v, int64_t k_ts, int64_t k_hs,
                      int64_t v_ts, int64_t v_hs, uint16_t* kc, uint16_t* vc, int64_t blk_s,
                      int64_t tok_s, int64_t head_s, const int64_t* slots, int n, int hkv, int d,
                      int block_size) {
    write_kv(k, v, k_ts, k_hs, v_ts, v_hs, kc, vc, blk_s, tok_s, head_s, slots, n, hkv, d,
             block_size, 1);
}

/* ---- decode attention: the portable loops ---------------------------------------------- */

/* Sequence s, kv head hk, one query head at a time. scores: len - first floats (token t at
 * t - first); acc: D floats. */
PD_INLINE void decode_head_portable(const decode_call* call, int s, int hk, float* scores,
                                    float* acc, const int bf16) {
    const void *q = call->q, *kc = call->kc, *vc = call->vc;
    void* out = call->out;
    const int64_t blk_s = call->blk_s, tok_s = call->tok_s, head_s = call->head_s;
    const int32_t* table = call->bt + (int64_t)s * call->bt_s;
    const int len = call->seq_lens[s], block_size = call->block_size, D = call->D;
    const int first = first_token(call, len);
    const int H = call->H, G = H / call->hkv;
    const float scale = call->scale;
    for (int g = 0; g < G; g++) {
        const void* qp = elem_at(q, s * call->q_ts + (int64_t)(hk * G + g) * call->q_hs, bf16);
        float mx = -INFINITY;
        for (int t = first; t < len; t++) {
            const void* kp =
                elem_at(kc, token_at(table, t, block_size, blk_s, tok_s) + hk * head_s, bf16);
            float dot = 0.f;
            for (int i = 0; i < D; i++) dot += load_elem(qp, i, bf16) * load_elem(kp, i, bf16);
            dot *= scale;
            scores[t - first] = dot;
            if (dot > mx) mx = dot;
        }
        float sum = 0.f;
        for (int t = 0; t < len - first; t++) {
            scores[t] = expf(scores[t] - mx);
            sum += scores[t];
        }
        for (int i = 0; i < D; i++) acc[i] = 0.f;
        for (int t = first; t < len; t++) {
            const void* vp =
                elem_at(vc, token_at(table, t, block_size, blk_s, tok_s) + hk * head_s, bf16);
            for (int i = 0; i < D; i++) acc[i] += scores[t - first] * load_elem(vp, i, bf16);
        }
        void* op = (char*)out + ((int64_t)s * H + hk * G + g) * D * elem_size(bf16);
        for (int i = 0; i < D; i++) store_elem(op, i, acc[i] / sum, bf16);
    }
}

/* ---- decode attention: the task split ---------------------------------------------------- */

/* Each entry point (call->bf16 == bf16) gets its own copy, and so its own parallel region. */
PD_INLINE void decode(const decode_call* call, int nthreads, const int bf16) {
    const int S = call->S, H = call->H, hkv = call->hkv, D = call->D;
    const int G = H / hkv;
    /* The longest run of scores a task keeps: from its first token (rounded down to 16, the
     * widest decoder's tiles) to the end. */
    int max_len = 1;
    for (int s = 0; s < S; s++) {
        const int len = call->seq_lens[s], span = len - (first_token(call, len) & ~15);
        if (span > max_len) max_len = span;
    }
    const int64_t stride_g = ((int64_t)max_len + 31) & ~(int64_t)15;
    const int vec = vec_decode_takes(G, D, call->block_size);
    const int per_seq = vec && S >= 4 * nthreads;
    const int ntasks = per_seq ? S : S * hkv;
#pragma omp parallel num_threads(nthreads)
    {
        const int rows = per_seq ? H : G;
        float* scores = (float*)aligned_alloc(64, sizeof(float) * (size_t)(rows * stride_g));
        float* work = (float*)aligned_alloc(64, sizeof(float) * (size_t)(H * (2 * D + 16) + 16));
        float* acc = (float*)malloc(sizeof(float) * (size_t)D);
#pragma omp for schedule(dynamic)
        for (int task = 0; task < ntasks; task++) {
            const int s = per_seq ? task : task / hkv, hk = per_seq ? 0 : task % hkv;
            if (call->seq_lens[s] <= 0) continue;
            if (per_seq)
                vec_decode_sequence(call, s, scores, stride_g, work);
            else if (vec)
                vec_decode_head(call, s, hk, scores, stride_g, work);
            else
                decode_head_portable(call, s, hk, scores, acc, bf16);
        }
        free(acc);
        free(work);
        free(scores);
    }
}

void pd_decode_attention_f32(const float* q, int64_t q_ts, int64_t q_hs, const float* kc,
                             const float* vc, int64_t blk_s, int64_t tok_s, int64_t head_s,
                             const int32_t* bt, int64_t bt_s, const int32_t* seq_lens, int S,
                             int H, int hkv, int D, int block_size, int window, float scale,
                             float* out, int nthreads) {
    const decode_call call = {.q = q, .q_ts = q_ts, .q_hs = q_hs, .kc = kc, .vc = vc,
                              .blk_s = blk_s, .tok_s = tok_s, .head_s = head_s, .bt = bt,
                              .bt_s = bt_s, .seq_lens = seq_lens, .S = S, .H = H, .hkv = hkv,
                              .D = D, .block_size = block_size, .window = window,
                              .scale = scale, .out = out,
                              .bf16 = 0};
    decode(&call, nthreads, 0);
}

void pd_decode_attention_bf16(const uint16_t* q, int64_t q_ts, int64_t q_hs, const uint16_t* kc,
                              const uint16_t* vc, int64_t blk_s, int64_t tok_s, int64_t head_s,
                              const int32_t* bt, int64_t bt_s, const int32_t* seq_lens, int S,
                              int H, int hkv, int D, int block_size, int window, float scale,
                              uint16_t* out, int nthreads) {
    const decode_call call = {.q = q, .q_ts = q_ts, .q_hs = q_hs, .kc = kc, .vc = vc,
                              .blk_s = blk_s, .tok_s = tok_s, .head_s = head_s, .bt = bt,
                              .bt_s = bt_s, .seq_lens = seq_lens, .S = S, .H = H, .hkv = hkv,
                              .D = D, .block_size = block_size, .window = window,
                              .scale = scale, .out = out,
                              .bf16 = 1};
    decode(&call, nthreads, 1);
}
