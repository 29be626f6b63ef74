/* The AVX-512 variant's decode (16 lanes), specialised for group sizes 1 to 8 and head
 * dims 32, 64 and 128 (G and C = D / 16 constants in each copy of a body, so that q, the
 * partial dots and the accumulators stay in registers), block sizes a multiple of 16 (each
 * run of 16 tokens lies in one block).
 *
 * A head alone (decode_head: a small batch) keeps its state in registers; a whole sequence
 * (decode_sequence: a large batch) goes a 16-token tile at a time over every head, so that
 * each tile's K (then V) rows of all heads are read together, which in the engine's
 * head-major blocks is one contiguous run per block, and the hardware prefetcher streams
 * it. Both do the same arithmetic in the same order (the query scaled in fp32, the same
 * dot-product chains and sums, the V sum over tokens in order), so they give equal
 * results; only the state between tiles (running maxima, V sums) lives in `work`.
 *
 * A sliding window starts a sequence at its first_token t1: the tiles at t1 rounded down
 * to 16 (still in t1's block; the lanes before t1 masked out of the scores and skipped in
 * the V sums), so no block before t1's is read. A tile's scores are kept at t0 - t_lo,
 * t_lo = t1 & ~15. The mask of the first tile is set apart, and the V rows start at 0 in
 * every other: this keeps GCC's code for the loops as fast as without a window.
 */
#include "cpu_attention.h"
#include "vec_avx512.h"

enum { MAX_G = 8, MAX_C = 8 }; /* group sizes up to 8, head dims up to 128 */

/* Ask for the next 16 cache rows (each row_bytes long, rows stride_bytes apart) early: a
 * block's slab is a short stream on its own page, which the hardware prefetcher misses. */
static inline void prefetch_rows(const void* p, int64_t stride_bytes, int row_bytes) {
    const char* base = (const char*)p;
    for (int r = 0; r < 16; r++)
        for (int b = 0; b < row_bytes; b += 64)
            _mm_prefetch(base + r * stride_bytes + b, _MM_HINT_T0);
}

/* prefetch_rows for each of hkv heads, head_bytes apart. */
static inline void prefetch_heads(const void* p, int hkv, int64_t head_bytes,
                                  int64_t stride_bytes, int row_bytes) {
    for (int hk = 0; hk < hkv; hk++)
        prefetch_rows((const char*)p + hk * head_bytes, stride_bytes, row_bytes);
}

/* One (sequence, kv head) task. scores: [G][stride_g]. */
PD_INLINE void decode_head_body(const decode_call* call, int s, int hk, const int G, const int C,
                                const int bf16, float* scores, int64_t stride_g) {
    const void *q = call->q, *kc = call->kc, *vc = call->vc;
    void* out = call->out;
    const int64_t blk_s = call->blk_s, tok_s = call->tok_s, head_s = call->head_s;
    const int32_t* table = call->bt + (int64_t)s * call->bt_s;
    const int len = call->seq_lens[s], block_size = call->block_size, H = call->H;
    const int first = first_token(call, len), t_lo = first & ~15;
    const int es = elem_size(bf16);
    __m512 qv[MAX_G][MAX_C], acc[MAX_G][MAX_C], mx[MAX_G];
    const __m512 sc = _mm512_set1_ps(call->scale);
    for (int g = 0; g < G; g++) {
        const void* qp = elem_at(q, s * call->q_ts + (int64_t)(hk * G + g) * call->q_hs, bf16);
        for (int c = 0; c < C; c++) qv[g][c] = _mm512_mul_ps(vf_load(qp, 16 * c, bf16), sc);
        mx[g] = _mm512_set1_ps(-INFINITY);
    }
    const __mmask16 skip = (__mmask16)((1u << (first - t_lo)) - 1u); /* the first tile's */
    for (int t0 = t_lo; t0 < len; t0 += 16) {
        const int tn = len - t0 < 16 ? len - t0 : 16;
        const int64_t tile = token_at(table, t0, block_size, blk_s, tok_s) + hk * head_s;
        const void* kb = elem_at(kc, tile, bf16);
        if (t0 + 16 < len) {
            const int64_t next = token_at(table, t0 + 16, block_size, blk_s, tok_s) + hk * head_s;
            prefetch_rows(elem_at(kc, next, bf16), tok_s * es, es * 16 * C);
        }
        __m512 part[MAX_G][16];
        for (int j = 0; j < 16; j++) {
            const void* kp = elem_at(kb, (int64_t)(j < tn ? j : 0) * tok_s, bf16);
            __m512 kv[MAX_C];
            for (int c = 0; c < C; c++) kv[c] = vf_load(kp, 16 * c, bf16);
            for (int g = 0; g < G; g++) {
                __m512 x = _mm512_mul_ps(qv[g][0], kv[0]);
                for (int c = 1; c < C; c++) x = _mm512_fmadd_ps(qv[g][c], kv[c], x);
                part[g][j] = x;
            }
        }
        const __mmask16 valid = (__mmask16)((1u << tn) - 1u) & ~(t0 == t_lo ? skip : 0);
        for (int g = 0; g < G; g++) {
            const __m512 d = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                  vf_transpose_sum(part[g]));
            _mm512_store_ps(scores + g * stride_g + (t0 - t_lo), d);
            mx[g] = _mm512_max_ps(mx[g], d);
        }
    }
    float inv[MAX_G];
    for (int g = 0; g < G; g++) {
        const __m512 m = _mm512_set1_ps(vf_hmax(mx[g]));
        float* p = scores + g * stride_g;
        __m512 sum = _mm512_setzero_ps();
        for (int t0 = t_lo; t0 < len; t0 += 16) {
            const __m512 e = vf_exp(_mm512_sub_ps(_mm512_load_ps(p + (t0 - t_lo)), m));
            _mm512_store_ps(p + (t0 - t_lo), e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[g] = 1.f / vf_hsum(sum);
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    }
    for (int t0 = t_lo; t0 < len; t0 += 16) {
        const int tn = len - t0 < 16 ? len - t0 : 16, j0 = t0 == t_lo ? first - t_lo : 0;
        const int64_t tile = token_at(table, t0, block_size, blk_s, tok_s) + hk * head_s;
        const void* vb = elem_at(vc, tile, bf16);
        if (t0 + 16 < len) {
            const int64_t next = token_at(table, t0 + 16, block_size, blk_s, tok_s) + hk * head_s;
            prefetch_rows(elem_at(vc, next, bf16), tok_s * es, es * 16 * C);
        }
        for (int j = j0; j < tn; j++) {
            const void* vp = elem_at(vb, (int64_t)j * tok_s, bf16);
            __m512 vv[MAX_C];
            for (int c = 0; c < C; c++) vv[c] = vf_load(vp, 16 * c, bf16);
            for (int g = 0; g < G; g++) {
                const __m512 pg = _mm512_set1_ps(scores[g * stride_g + (t0 - t_lo) + j]);
                for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        void* op = (char*)out + ((int64_t)s * H + hk * G + g) * 16 * C * es;
        const __m512 iv = _mm512_set1_ps(inv[g]);
        for (int c = 0; c < C; c++) vf_store(op, 16 * c, _mm512_mul_ps(acc[g][c], iv), bf16);
    }
}

/* One sequence, every kv head, a 16-token tile at a time. scores: [H][stride_g]; work:
 * [H][16 C] the scaled query, [H][16 C] the V sums, [H][16] running maxima. */
PD_INLINE void decode_sequence_body(const decode_call* call, int s, const int G, const int C,
                                    const int bf16, float* scores, int64_t stride_g,
                                    float* work) {
    const void *q = call->q, *kc = call->kc, *vc = call->vc;
    void* out = call->out;
    const int64_t blk_s = call->blk_s, tok_s = call->tok_s, head_s = call->head_s;
    const int32_t* table = call->bt + (int64_t)s * call->bt_s;
    const int len = call->seq_lens[s], block_size = call->block_size;
    const int first = first_token(call, len), t_lo = first & ~15;
    const int H = call->H, hkv = call->hkv;
    const int es = elem_size(bf16);
    float* qf = work;
    float* accf = work + H * 16 * C;
    float* mxf = work + 2 * H * 16 * C;
    const __m512 sc = _mm512_set1_ps(call->scale);
    for (int h = 0; h < H; h++) {
        const void* qp = elem_at(q, s * call->q_ts + (int64_t)h * call->q_hs, bf16);
        for (int c = 0; c < C; c++)
            _mm512_store_ps(qf + (h * C + c) * 16, _mm512_mul_ps(vf_load(qp, 16 * c, bf16), sc));
        _mm512_store_ps(mxf + h * 16, _mm512_set1_ps(-INFINITY));
    }
    const int row_bytes = es * 16 * C;
    const __mmask16 skip = (__mmask16)((1u << (first - t_lo)) - 1u); /* the first tile's */
    for (int t0 = t_lo; t0 < len; t0 += 16) {
        const int tn = len - t0 < 16 ? len - t0 : 16;
        const __mmask16 valid = (__mmask16)((1u << tn) - 1u) & ~(t0 == t_lo ? skip : 0);
        const void* kt = elem_at(kc, token_at(table, t0, block_size, blk_s, tok_s), bf16);
        if (t0 + 16 < len)
            prefetch_heads(elem_at(kc, token_at(table, t0 + 16, block_size, blk_s, tok_s), bf16),
                           hkv, head_s * es, tok_s * es, row_bytes);
        for (int hk = 0; hk < hkv; hk++) {
            const void* kb = elem_at(kt, hk * head_s, bf16);
            for (int g = 0; g < G; g++) {
                const int h = hk * G + g;
                __m512 qv[MAX_C], part[16];
                for (int c = 0; c < C; c++) qv[c] = _mm512_load_ps(qf + (h * C + c) * 16);
#pragma GCC unroll 16 /* the 16 partial dots stay in registers for the transposing sum */
                for (int j = 0; j < 16; j++) {
                    const void* kp = elem_at(kb, (int64_t)(j < tn ? j : 0) * tok_s, bf16);
                    __m512 x = _mm512_mul_ps(qv[0], vf_load(kp, 0, bf16));
                    for (int c = 1; c < C; c++)
                        x = _mm512_fmadd_ps(qv[c], vf_load(kp, 16 * c, bf16), x);
                    part[j] = x;
                }
                const __m512 d = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                                      vf_transpose_sum(part));
                _mm512_store_ps(scores + h * stride_g + (t0 - t_lo), d);
                _mm512_store_ps(mxf + h * 16, _mm512_max_ps(_mm512_load_ps(mxf + h * 16), d));
            }
        }
    }
    for (int h = 0; h < H; h++) {
        const __m512 m = _mm512_set1_ps(vf_hmax(_mm512_load_ps(mxf + h * 16)));
        float* p = scores + h * stride_g;
        __m512 sum = _mm512_setzero_ps();
        for (int t0 = t_lo; t0 < len; t0 += 16) {
            const __m512 e = vf_exp(_mm512_sub_ps(_mm512_load_ps(p + (t0 - t_lo)), m));
            _mm512_store_ps(p + (t0 - t_lo), e);
            sum = _mm512_add_ps(sum, e);
        }
        mxf[h * 16] = 1.f / vf_hsum(sum); /* the maxima are done with */
        for (int c = 0; c < C; c++) _mm512_store_ps(accf + (h * C + c) * 16, _mm512_setzero_ps());
    }
    for (int t0 = t_lo; t0 < len; t0 += 16) {
        const int tn = len - t0 < 16 ? len - t0 : 16, j0 = t0 == t_lo ? first - t_lo : 0;
        const void* vt = elem_at(vc, token_at(table, t0, block_size, blk_s, tok_s), bf16);
        if (t0 + 16 < len)
            prefetch_heads(elem_at(vc, token_at(table, t0 + 16, block_size, blk_s, tok_s), bf16),
                           hkv, head_s * es, tok_s * es, row_bytes);
        for (int hk = 0; hk < hkv; hk++) {
            const void* vb = elem_at(vt, hk * head_s, bf16);
            __m512 acc[MAX_G][MAX_C];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++)
                    acc[g][c] = _mm512_load_ps(accf + ((hk * G + g) * C + c) * 16);
            for (int j = j0; j < tn; j++) {
                const void* vp = elem_at(vb, (int64_t)j * tok_s, bf16);
                __m512 vv[MAX_C];
                for (int c = 0; c < C; c++) vv[c] = vf_load(vp, 16 * c, bf16);
                for (int g = 0; g < G; g++) {
                    const float* p = scores + (hk * G + g) * stride_g + (t0 - t_lo);
                    const __m512 pg = _mm512_set1_ps(p[j]);
                    for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++)
                    _mm512_store_ps(accf + ((hk * G + g) * C + c) * 16, acc[g][c]);
        }
    }
    for (int h = 0; h < H; h++) {
        void* op = (char*)out + ((int64_t)s * H + h) * 16 * C * es;
        const __m512 iv = _mm512_set1_ps(mxf[h * 16]);
        for (int c = 0; c < C; c++)
            vf_store(op, 16 * c, _mm512_mul_ps(_mm512_load_ps(accf + (h * C + c) * 16), iv), bf16);
    }
}

/* The bodies with G and C constants: a copy for each pair taken, picked by a switch on
 * each. */
PD_INLINE void decode_sequence_of_dim(const decode_call* call, int s, const int G, const int bf16,
                                      float* scores, int64_t stride_g, float* work) {
    switch (call->D / 16) {
        case 2: decode_sequence_body(call, s, G, 2, bf16, scores, stride_g, work); return;
        case 4: decode_sequence_body(call, s, G, 4, bf16, scores, stride_g, work); return;
        case 8: decode_sequence_body(call, s, G, 8, bf16, scores, stride_g, work); return;
    }
}

PD_INLINE void decode_sequence_of_group(const decode_call* call, int s, const int bf16,
                                        float* scores, int64_t stride_g, float* work) {
    switch (call->H / call->hkv) {
        case 1: decode_sequence_of_dim(call, s, 1, bf16, scores, stride_g, work); return;
        case 2: decode_sequence_of_dim(call, s, 2, bf16, scores, stride_g, work); return;
        case 3: decode_sequence_of_dim(call, s, 3, bf16, scores, stride_g, work); return;
        case 4: decode_sequence_of_dim(call, s, 4, bf16, scores, stride_g, work); return;
        case 5: decode_sequence_of_dim(call, s, 5, bf16, scores, stride_g, work); return;
        case 6: decode_sequence_of_dim(call, s, 6, bf16, scores, stride_g, work); return;
        case 7: decode_sequence_of_dim(call, s, 7, bf16, scores, stride_g, work); return;
        case 8: decode_sequence_of_dim(call, s, 8, bf16, scores, stride_g, work); return;
    }
}

PD_INLINE void decode_head_of_dim(const decode_call* call, int s, int hk, const int G,
                                  const int bf16, float* scores, int64_t stride_g) {
    switch (call->D / 16) {
        case 2: decode_head_body(call, s, hk, G, 2, bf16, scores, stride_g); return;
        case 4: decode_head_body(call, s, hk, G, 4, bf16, scores, stride_g); return;
        case 8: decode_head_body(call, s, hk, G, 8, bf16, scores, stride_g); return;
    }
}

PD_INLINE void decode_head_of_group(const decode_call* call, int s, int hk, const int bf16,
                                    float* scores, int64_t stride_g) {
    switch (call->H / call->hkv) {
        case 1: decode_head_of_dim(call, s, hk, 1, bf16, scores, stride_g); return;
        case 2: decode_head_of_dim(call, s, hk, 2, bf16, scores, stride_g); return;
        case 3: decode_head_of_dim(call, s, hk, 3, bf16, scores, stride_g); return;
        case 4: decode_head_of_dim(call, s, hk, 4, bf16, scores, stride_g); return;
        case 5: decode_head_of_dim(call, s, hk, 5, bf16, scores, stride_g); return;
        case 6: decode_head_of_dim(call, s, hk, 6, bf16, scores, stride_g); return;
        case 7: decode_head_of_dim(call, s, hk, 7, bf16, scores, stride_g); return;
        case 8: decode_head_of_dim(call, s, hk, 8, bf16, scores, stride_g); return;
    }
}

static void decode_sequence_f32(const decode_call* call, int s, float* scores, int64_t stride_g,
                                float* work) {
    decode_sequence_of_group(call, s, 0, scores, stride_g, work);
}

static void decode_sequence_bf16(const decode_call* call, int s, float* scores,
                                 int64_t stride_g, float* work) {
    decode_sequence_of_group(call, s, 1, scores, stride_g, work);
}

static void decode_head_f32(const decode_call* call, int s, int hk, float* scores,
                            int64_t stride_g) {
    decode_head_of_group(call, s, hk, 0, scores, stride_g);
}

static void decode_head_bf16(const decode_call* call, int s, int hk, float* scores,
                             int64_t stride_g) {
    decode_head_of_group(call, s, hk, 1, scores, stride_g);
}

int vec_decode_takes(int G, int D, int block_size) {
    const int C = D / 16;
    return D % 16 == 0 && block_size % 16 == 0 && G >= 1 && G <= MAX_G &&
           (C == 2 || C == 4 || C == 8);
}

void vec_decode_sequence(const decode_call* call, int s, float* scores, int64_t stride_g,
                         float* work) {
    if (call->bf16)
        decode_sequence_bf16(call, s, scores, stride_g, work);
    else
        decode_sequence_f32(call, s, scores, stride_g, work);
}

void vec_decode_head(const decode_call* call, int s, int hk, float* scores, int64_t stride_g,
                     float* work) {
    (void)work;
    if (call->bf16)
        decode_head_bf16(call, s, hk, scores, stride_g);
    else
        decode_head_f32(call, s, hk, scores, stride_g);
}
