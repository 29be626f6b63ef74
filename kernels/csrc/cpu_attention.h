/* Decode attention inside one variant: a call's arguments, and what the variant's vector
 * decoder (cpu_attention_<isa>.c) offers the task loop of cpu_attention.c.
 *
 * A variant is cpu_attention.c with one decoder file, built for one ISA (cpu_build.py):
 * portable (no vector decoder: the loops of cpu_attention.c), avx2 (8 lanes), avx512 (16).
 * Each decoder takes the shapes it is specialised for, with the arithmetic fixed so that a
 * head's result does not depend on how the heads are split into tasks.
 */
#ifndef PD_CPU_ATTENTION_H
#define PD_CPU_ATTENTION_H

#include <math.h>
#include <stdint.h>

#include "cpu_common.h"

/* The arguments of pd_decode_attention_f32/bf16 (pdserve_kernels.h); q, kc, vc and out
 * hold float, or bf16 bits where bf16 is 1. */
typedef struct {
    const void* q;
    int64_t q_ts, q_hs;
    const void* kc;
    const void* vc;
    int64_t blk_s, tok_s, head_s;
    const int32_t* bt;
    int64_t bt_s;
    const int32_t* seq_lens;
    int S, H, hkv, D, block_size, window;
    float scale;
    void* out;
    int bf16;
} decode_call;

/* The element offset of token t of a sequence (its block from the table, then its row). */
static inline int64_t token_at(const int32_t* table, int t, int block_size, int64_t blk_s,
                               int64_t tok_s) {
    return table[t / block_size] * blk_s + (int64_t)(t % block_size) * tok_s;
}

/* The first token a sequence of length len attends: len - window under a sliding window
 * (window > 0) that the sequence outgrows, else 0. No cache row before it is read. */
static inline int first_token(const decode_call* call, int len) {
    return call->window > 0 && len > call->window ? len - call->window : 0;
}

/* 1 when the vector decoder takes calls of group size G = H / hkv, head dim D and this
 * block size; the others take the portable loops. */
int vec_decode_takes(int G, int D, int block_size);

/* Sequence s, every kv head in one task (a large batch). scores: [H][stride_g] floats, row
 * entry i the score of token (first_token & ~15) + i at most (a decoder's tiles start at its
 * lane count's multiple); work: H * (2 D + 16) + 16 floats, both 64-byte aligned. */
void vec_decode_sequence(const decode_call* call, int s, float* scores, int64_t stride_g,
                         float* work);

/* Sequence s, kv head hk (a small batch: the heads shared among the threads). scores:
 * [G][stride_g]; work as above. */
void vec_decode_head(const decode_call* call, int s, int hk, float* scores, int64_t stride_g,
                     float* work);

#endif /* PD_CPU_ATTENTION_H */
