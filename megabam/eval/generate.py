"""Long inputs in bounded memory: the prompt goes through `Decoder.stream` a chunk at a time.

Attention layers keep their keys and values (a KV cache linear in the context) and score each chunk's
queries against them, so the largest temporary is chunk × context per head, never context²; SWA
layers keep a ring of `window` slots and mLSTM / Gated DeltaNet layers a fixed-size state, so a SWAX
model's memory does not grow with the context at all. Logits are reduced (argmax, loss) chunk by
chunk and never held for the whole input.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megabam.model import Decoder

DEFAULT_CHUNK = 1024


@torch.no_grad()
def _chunks(model: Decoder, ids: torch.Tensor, chunk: int, reduce: Callable[[torch.Tensor, int], torch.Tensor]):
    """`reduce(logits of a chunk, its start)` for each chunk of the one-row input `ids`, and the state after."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected one row of token ids (1, N), got shape {tuple(ids.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    state, parts = None, []
    for start in range(0, ids.shape[1], chunk):
        logits, state = model.stream(ids[:, start : start + chunk], state)
        parts.append(reduce(logits[0].to(torch.promote_types(logits.dtype, torch.float32)), start))
    return parts, state


def predict_next(model: Decoder, ids: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The most likely next token at each position of `ids` (1, N) → (1, N); equal to the argmax of
    the one-shot forward."""
    parts, _ = _chunks(model, ids, chunk, lambda logits, start: logits.argmax(-1))
    return torch.cat(parts)[None]


def token_losses(model: Decoder, ids: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Next-token cross-entropy (nats) of tokens 1..N−1 of `ids` (1, N), each given all before it → (N−1,)."""
    targets = ids[0, 1:]

    def loss(logits: torch.Tensor, start: int) -> torch.Tensor:
        n = min(logits.shape[0], targets.shape[0] - start)  # the last position has no target
        return F.cross_entropy(logits[:n], targets[start : start + n], reduction="none")

    parts, _ = _chunks(model, ids, chunk, loss)
    return torch.cat(parts)


@torch.no_grad()
def generate_greedy(
    model: Decoder, prompt: list[int], max_new_tokens: int, stop: set[int] = frozenset(), chunk: int = DEFAULT_CHUNK
) -> list[int]:
    """Greedy decoding: the prompt prefilled chunk by chunk, then one token per step from the carried
    state (KV cache, SWA ring, recurrent state), until `max_new_tokens` or a token in `stop`."""
    device = model.embed.weight.device
    ids = torch.tensor([prompt], device=device)
    parts, state = _chunks(model, ids, chunk, lambda logits, start: logits[-1].argmax())
    out: list[int] = []
    token = int(parts[-1])
    while len(out) < max_new_tokens and token not in stop:
        out.append(token)
        if len(out) == max_new_tokens:
            break
        logits, state = model.stream(torch.tensor([[token]], device=device), state)
        token = int(logits[0, -1].argmax())
    return out
