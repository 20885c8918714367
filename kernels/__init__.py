"""Kernels beside their references: BAM attention and the chunkwise mLSTM cell, each as a pure-PyTorch
reference (CPU path) and Triton kernels tested against it (GPU path), and the dispatch point that
chooses between them."""
