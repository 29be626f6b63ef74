/* bf16 GEMM on Intel AMX for decode-sized batches: y[M, N] = x[M, K] @ W^T (+ bias).
 * Built and loaded by kernels/cpu_build.py; the torch side is kernels/gemm_cpu.py, the
 * interface pdserve_kernels.h.
 *
 * At decode sizes (a few to a few dozen rows) a linear layer is bound by reading its
 * weights once; oneDNN's small-M path reads them well below the memory bandwidth here.
 * This kernel streams a weight packed once into AMX's B-tile layout ([N/16][K/32] tiles
 * of 16 k-pairs x 16 columns x 2) and keeps a 32-column panel in L2 while it walks the
 * rows 32 at a time; a larger batch (a prefill chunk) goes by blocks of rows that fit in
 * L2, each block passing over every panel. Needs K % 32 == 0 and N % 32 == 0; fp32
 * accumulation, bf16 output rounded to nearest even.
 *
 * The kernel's one variant, amx (built with -march=x86-64-v4 and the AMX and AVX512-BF16
 * flags on every machine); the Python side loads it only on CPUs with AMX, and calls
 * pd_amx_init() first.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "pdserve_kernels.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux gives a process the AMX tile state only when it asks (once). */
int pd_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

/* W [N, K] bf16 -> [N/16][K/32][16 k-pairs][16 n][2]: one 1 KiB B tile per (16 cols, 32 k). */
void pd_amx_pack(const uint16_t* w, uint16_t* out, int N, int K) {
    for (int nb = 0; nb < N / 16; nb++)
        for (int kb = 0; kb < K / 32; kb++) {
            uint16_t* dst = out + ((size_t)nb * (K / 32) + kb) * 512;
            for (int k2 = 0; k2 < 16; k2++)
                for (int n = 0; n < 16; n++)
                    for (int p = 0; p < 2; p++)
                        dst[(k2 * 16 + n) * 2 + p] = w[(size_t)(nb * 16 + n) * K + kb * 32 + 2 * k2 + p];
        }
}

/* tiles: 0..3 C (rows m0 | m1), 4,5 A (rows m0, m1), 6,7 B */
static void config(int m0, int m1) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = cfg.rows[1] = m0;
    cfg.rows[2] = cfg.rows[3] = m1 ? m1 : 1;
    cfg.rows[4] = m0;
    cfg.rows[5] = m1 ? m1 : 1;
    cfg.rows[6] = cfg.rows[7] = 16;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

static inline void store_rows(const float* acc, const uint16_t* bias, uint16_t* y, int m, int ldy, int n0) {
    __m512 b = _mm512_setzero_ps();
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0))), 16));
    for (int r = 0; r < m; r++) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b);
        _mm256_storeu_si256((__m256i*)(y + (size_t)r * ldy + n0), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

#ifndef A_BLOCK_BYTES
#define A_BLOCK_BYTES (512 * 1024)
#endif

/* y[M, N] = x[M, K] @ W^T + bias. Each thread takes a range of 32-column panels; for each block
 * of RB rows and each panel it walks the rows 32 at a time (the panel's weights, K x 32, stay
 * in L2 across row chunks, and the block of x across panels). */
void pd_amx_linear(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y, int M, int N, int K, int nthreads) {
    const int KB = K / 32, NP = N / 32;
    /* Rows per block: a block of x (RB x K) stays in L2 while every panel passes over it. */
    const int RB = K * 2 * 32 > A_BLOCK_BYTES ? 32 : A_BLOCK_BYTES / (K * 2) / 32 * 32;
    #pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = NP * t / nt, p1 = NP * (t + 1) / nt;
        float acc[4][256] __attribute__((aligned(64)));
        int cur0 = -1, cur1 = -1;
        for (int rb = 0; rb < M; rb += RB) {
            const int rb_end = M - rb < RB ? M : rb + RB;
            for (int p = p0; p < p1; p++) {
                const uint16_t* b0 = wp + (size_t)(2 * p) * KB * 512;
                const uint16_t* b1 = b0 + (size_t)KB * 512;
                for (int r0 = rb; r0 < rb_end; r0 += 32) {
                    const int m0 = M - r0 < 16 ? M - r0 : 16;
                    const int m1 = M - r0 - 16 <= 0 ? 0 : (M - r0 - 16 < 16 ? M - r0 - 16 : 16);
                    if (m0 != cur0 || m1 != cur1) { config(m0, m1); cur0 = m0; cur1 = m1; }
                    const uint16_t* a0 = x + (size_t)r0 * K;
                    const uint16_t* a1 = a0 + (size_t)16 * K;
                    _tile_zero(0); _tile_zero(1);
                    if (m1) {
                        _tile_zero(2); _tile_zero(3);
                        for (int kb = 0; kb < KB; kb++) {
                            _tile_loadd(4, a0 + kb * 32, K * 2);
                            _tile_loadd(6, b0 + (size_t)kb * 512, 64);
                            _tile_loadd(7, b1 + (size_t)kb * 512, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_loadd(5, a1 + kb * 32, K * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    } else {
                        for (int kb = 0; kb < KB; kb++) {
                            _tile_loadd(4, a0 + kb * 32, K * 2);
                            _tile_loadd(6, b0 + (size_t)kb * 512, 64);
                            _tile_loadd(7, b1 + (size_t)kb * 512, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                    }
                    _tile_stored(0, acc[0], 64); _tile_stored(1, acc[1], 64);
                    store_rows(acc[0], bias, y + (size_t)r0 * N, m0, N, 32 * p);
                    store_rows(acc[1], bias, y + (size_t)r0 * N, m0, N, 32 * p + 16);
                    if (m1) {
                        _tile_stored(2, acc[2], 64); _tile_stored(3, acc[3], 64);
                        store_rows(acc[2], bias, y + (size_t)(r0 + 16) * N, m1, N, 32 * p);
                        store_rows(acc[3], bias, y + (size_t)(r0 + 16) * N, m1, N, 32 * p + 16);
                    }
                }
            }
        }
        _tile_release();
    }
}
