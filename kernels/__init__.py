"""Attention kernels: plain-torch references and (on CUDA) Triton kernels with the same signatures."""
