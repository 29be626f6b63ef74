"""CPU kernel microbenchmarks: attention, sgemm, block checksums, and the GEMM ceiling."""
