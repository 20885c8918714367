"""Attention kernels: the pure-PyTorch BAM reference (CPU path) and the Triton kernels tested against it."""
