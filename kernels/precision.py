"""The compute dtype of the ops and cells: the one rule, used by every op and mixer that needs it."""

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for fp32 and lower-precision inputs (exponentials, softmax and long sums lose too much in
    bf16/fp16), fp64 for fp64 inputs (the float64 references of the tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
