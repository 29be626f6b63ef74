/* The C interface of pdserve's CPU kernels: every function that Python (ctypes, in
 * kernels/attention_cpu.py, sgemm_cpu.py, gemm_cpu.py, sample_cpu.py) or the C++ operators
 * (torch_ops.cpp) call, declared once.
 *
 * kernels/cpu_build.py builds each kernel once per instruction set it has a variant for
 * (portable, avx2, avx512, amx: its KERNELS table), each variant a shared object of its own
 * with its own target flags, and loads the widest one this CPU runs. Every variant of a
 * kernel defines that kernel's functions below, with these signatures. The .c files and
 * torch_ops.cpp include this header, so the compiler checks them against it;
 * tests/unit/test_cpu_kernels.py checks the ctypes signatures against it.
 *
 * Element types: float is fp32, uint16_t the bits of a bf16. Strides count elements.
 */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What a shared object exports (each is built with -fvisibility=hidden). */
#define PD_API __attribute__((visibility("default")))

/* ---- attention (cpu_attention*.c): variants portable, avx2, avx512 -------------------- */

/* Cache addressing, per layer: element (block, token, kv_head, d) is at
 *   block * blk_s + token * tok_s + kv_head * head_s + d          (d contiguous)
 * and a token's slot is block * block_size + token. */

/* k, v: [n, hkv, d] (strides k_ts, k_hs and v_ts, v_hs) into the slots of kc, vc; a
 * negative slot (a padding row) is skipped. */
PD_API void pd_write_kv_f32(const float* k, const float* v, int64_t k_ts, int64_t k_hs,
                            int64_t v_ts, int64_t v_hs, float* kc, float* vc, int64_t blk_s,
                            int64_t tok_s, int64_t head_s, const int64_t* slots, int n, int hkv,
                            int d, int block_size);
PD_API void pd_write_kv_bf16(const uint16_t* k, const uint16_t* v, int64_t k_ts, int64_t k_hs,
                             int64_t v_ts, int64_t v_hs, uint16_t* kc, uint16_t* vc,
                             int64_t blk_s, int64_t tok_s, int64_t head_s, const int64_t* slots,
                             int n, int hkv, int d, int block_size);

/* q: [S, H, D] (strides q_ts, q_hs); bt: [S, max_blocks] int32 block tables (row stride
 * bt_s); seq_lens: [S] int32; out: [S, H, D] contiguous, a sequence of length 0 untouched.
 * window > 0: a sequence of length len attends its tokens max(0, len - window)..len - 1
 * only, and reads no cache row before them; 0 attends the whole context. */
PD_API void pd_decode_attention_f32(const float* q, int64_t q_ts, int64_t q_hs, const float* kc,
                                    const float* vc, int64_t blk_s, int64_t tok_s,
                                    int64_t head_s, const int32_t* bt, int64_t bt_s,
                                    const int32_t* seq_lens, int S, int H, int hkv, int D,
                                    int block_size, int window, float scale, float* out,
                                    int nthreads);
PD_API void pd_decode_attention_bf16(const uint16_t* q, int64_t q_ts, int64_t q_hs,
                                     const uint16_t* kc, const uint16_t* vc, int64_t blk_s,
                                     int64_t tok_s, int64_t head_s, const int32_t* bt,
                                     int64_t bt_s, const int32_t* seq_lens, int S, int H,
                                     int hkv, int D, int block_size, int window, float scale,
                                     uint16_t* out, int nthreads);

/* ---- float32 GEMM (cpu_sgemm.c): variant avx2 ------------------------------------------ */

/* W [N, K] -> [N/16][K][16] panels; N % 16 == 0. */
PD_API void pd_sgemm_pack(const float* w, float* out, int N, int K);
/* y[M, N] = x[M, K] @ W^T + bias (bias may be NULL); wp from pd_sgemm_pack. */
PD_API void pd_sgemm_linear(const float* x, const float* wp, const float* bias, float* y, int M,
                            int N, int K, int nthreads);

/* ---- bf16 GEMM on AMX (cpu_gemm.c): variant amx --------------------------------------- */

/* 1 when this process may use AMX tiles (asks Linux for the tile state), else 0. */
PD_API int pd_amx_init(void);
/* W [N, K] bf16 -> [N/16][K/32] B tiles; K % 32 == 0 and N % 32 == 0. */
PD_API void pd_amx_pack(const uint16_t* w, uint16_t* out, int N, int K);
/* y[M, N] = x[M, K] @ W^T + bias (bias may be NULL), bf16; wp from pd_amx_pack. */
PD_API void pd_amx_linear(const uint16_t* x, const uint16_t* wp, const uint16_t* bias,
                          uint16_t* y, int M, int N, int K, int nthreads);

/* ---- sampling (cpu_sample*.c): variants avx2, avx512 ------------------------------------ */

/* x: [rows, n] fp32 with row stride x_s; out: [rows] int64, as torch.argmax(x, dim=-1). */
PD_API void pd_argmax_f32(const float* x, int64_t x_s, int rows, int64_t n, int64_t* out,
                          int nthreads);
/* Structured outputs' token mask: for each of the rows listed in `rows` (nrows of them),
 * x[row, i] = -inf where bit i % 32 of mask[row, i / 32] is 0 (xgrammar's bitmask layout),
 * for i < n. x: fp32 with row stride x_s; mask: int32 with row stride m_s. */
PD_API void pd_apply_bitmask_f32(float* x, int64_t x_s, const int32_t* mask, int64_t m_s,
                                 const int64_t* rows, int nrows, int64_t n, int nthreads);

#ifdef __cplusplus
}
#endif

#endif /* PDSERVE_KERNELS_H */
