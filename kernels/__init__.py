"""Attention kernels: the pure-PyTorch BAM reference (CPU path), the fused Triton kernels tested
against it (GPU path), and the dispatch point that chooses between them."""
