"""The CUDA checks: the Triton attention kernels and the CUDA-graph decode path (check.sh
runs them all on a GPU machine)."""
