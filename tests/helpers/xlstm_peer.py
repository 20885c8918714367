"""A tiny random xLSTMForCausalLM built and saved by transformers itself (run with a transformers
whose xLSTM runs on CPU: 5.x) and its logits for a fixed batch, for the import test.

    python xlstm_peer.py OUT_DIR
writes OUT_DIR/single/ (save_pretrained) and OUT_DIR/single/logits.pt.
"""

import sys
from pathlib import Path

import torch
from transformers import xLSTMConfig, xLSTMForCausalLM

VOCAB, BATCH, LENGTH = 96, 2, 40


def main(out: Path) -> None:
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(5))
    shape = dict(vocab_size=VOCAB, hidden_size=32, num_heads=2, num_blocks=2, chunk_size=8)
    torch.manual_seed(0)
    # autocast_kernel_dtype: its default would compute the cell in bf16
    model = xLSTMForCausalLM(xLSTMConfig(**shape, autocast_kernel_dtype="float32")).eval()
    with torch.no_grad():  # weights far from their init (gate biases included), so every term counts
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (0.0 if p.ndim > 1 else p))
    model.save_pretrained(out / "single")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits  # its cached path fails for prompts of > 1 chunk
    torch.save({"ids": ids, "logits": logits}, out / "single" / "logits.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
