"""Memory per GPU of a layout, by part, in bytes.

- Weights: the rank's parameters (matrices split over tensor parallelism, vectors replicated; the
  heavier of the first pipeline stage, with the embedding, and the last, with the head and final norm)
  at the training dtype.
- Gradients and optimizer (DeepSpeed's ZeRO, Rajbhandari et al. 2020): ZeRO-1 keeps the whole gradient
  at the training dtype and partitions over data parallelism an fp32 master copy, its fp32 gradient and
  Adam's two moments (4 + 4 + 8 bytes per parameter ÷ DP); ZeRO-2 partitions the gradient too. Stage 0
  in fp32 is torch's AdamW (8 bytes of moments per parameter), in bf16 DeepSpeed's bf16 optimizer (fp32
  master, fp32 gradient and moments, 16 bytes, unpartitioned).
- Activations per micro-batch: what each block saves for its backward pass, per token
  (`block_activation_elements`: counted off megabam's own modules, no dropout, attention without the
  N × N scores — Korthikanti et al. 2022's accounting without its 5·a·s/h term, with a SwiGLU MLP and
  RMSNorm). Under tensor parallelism the mixer's and MLP's inner activations are split over TP ranks;
  the norms' are too only with sequence parallelism. Full recomputation keeps each block's input (plus
  one block's activations while it is recomputed), selective the block's activations without the
  recomputed mixers' own (plus one mixer's). Under 1F1B the first stage holds min(PP, micro-batches)
  micro-batches in flight, each of its layers' activations.
- Logits: the output loss runs in chunks of 1,024 tokens (kernels/linear_cross_entropy.py): one
  chunk's fp32 logits (their softmax gradient in place), and the fp32 gradients of the head and of the
  hidden states it computes in its forward pass.
- Workspace: the attention op's score tiles on CPU under model.kernels=reference (block × keys × heads
  × micro-batch, fp32, three at once in the backward pass); the C kernel that mode auto runs on CPU
  (kernels/bam_attention_cpu.py) and the Triton kernels keep theirs in cache or on chip.
- Buffers: ZeRO's gradient-reduction bucket, allocated at the first backward pass whatever the data
  parallelism (5e8 elements by default; megabam's DeepSpeed config caps it at the rank's parameters).
- Total: weights, optimizer, buffers and activations, plus the largest transient — the loss's logits
  at the end of the forward pass, or in the backward pass the gradients with the attention tiles and
  the block being recomputed (all at once: an upper bound) — plus 5 % for the allocator's fragmentation.
"""

from dataclasses import dataclass

from megabam.config import Config
from megabam.model import Decoder
from megabam.plan.counts import per_model

LOSS_CHUNK_TOKENS = 1024  # kernels/linear_cross_entropy.py CHUNK_TOKENS
DEEPSPEED_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce bucket (megabam caps it at the rank's parameters)
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    zero_stage: int = 1
    recompute: str = "none"
    micro_batch: int = 1
    grad_accum: int = 1
    sequence_parallel: bool = False

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.data

    def describe(self) -> str:
        sp = "+SP" if self.sequence_parallel else ""
        return (
            f"TP{self.tensor}{sp} PP{self.pipeline} DP{self.data} ZeRO-{self.zero_stage} recompute={self.recompute} "
            f"micro={self.micro_batch}×{self.grad_accum}"
        )


def _dtype_bytes(cfg: Config) -> int:
    return 2 if cfg.train.precision == "bf16" else 4


@per_model
def parameter_sizes(model: Decoder) -> tuple[tuple[tuple[int, bool], ...], ...]:
    """(numel, is a matrix) of each parameter of each block, then of the embedding and the untied head."""
    heads = [model.embed.weight, *([model.lm_head.weight] if model.lm_head is not None else [])]
    parts = [list(block.parameters()) for block in model.blocks] + [[weight] for weight in heads]
    return tuple(tuple((p.numel(), p.dim() >= 2) for p in part) for part in parts)


def rank_parameters(model: Decoder, layout: Layout) -> tuple[int, int]:
    """(parameters on the fullest rank, its blocks): matrices ÷ TP, vectors whole; the first stage
    holds the embedding and ⌈L/PP⌉ blocks, the last the head (or the tied embedding) and final norm."""
    t = layout.tensor

    def share(sizes) -> int:
        return sum(n // t if matrix else n for n, matrix in sizes)

    sizes = parameter_sizes(model)
    blocks = [share(b) for b in sizes[: len(model.blocks)]]
    per_stage = -(-len(blocks) // layout.pipeline)
    body = sum(sorted(blocks, reverse=True)[:per_stage])
    embedding = share(sizes[len(model.blocks)])
    head = share(sizes[-1]) if model.lm_head is not None else embedding
    if layout.pipeline == 1:
        return body + embedding + (head if model.lm_head is not None else 0) + model.cfg.d_model, per_stage
    return body + max(embedding, head + model.cfg.d_model), per_stage


def block_activation_elements(cfg: Config, block, layout: Layout, device: str) -> float:
    """Elements one block saves per token for its backward pass (at the activation dtype; the fp32
    log-sum-exp counted at its size in that dtype), read off megabam's modules: the norms and the
    SwiGLU what `_norms_and_mlp` says; attention the fused q|k|v, the RoPE-rotated q, k, the op's output
    where a fused op keeps it (the Triton kernel on GPU; on CPU in mode auto the C kernel, with k and v
    made contiguous in fp32; the reference op recomputes it) and its transposed copy, a log-sum-exp per
    head; the chunkwise mLSTM and Gated DeltaNet their inputs, gates, outputs and one state per chunk,
    and on CPU (the reference ops) four chunk × chunk tiles per head besides.
    Counted with megabam/train/live_tensors.py on the tiny configs (docs/benchmarks.md)."""
    m, t, sp = cfg.model, layout.tensor, layout.sequence_parallel
    h, b = m.d_model, _dtype_bytes(cfg)
    mixer = block.mixer
    outer, inner = _norms_and_mlp(cfg, device)
    if hasattr(mixer, "kv_heads"):  # attention or SWA
        kv = mixer.kv_heads * mixer.head_dim
        inner += h + 2 * kv + h + mixer.n_heads * 4 / b  # q|k|v, the transposed output, log-sum-exp
        if mixer.rope_theta is not None:
            inner += h + kv
        if device == "cuda":
            inner += h  # the fused op's own output
        elif m.kernels == "auto":  # the C kernel's output, k and v, in fp32
            inner += (h + 2 * kv) * 4 / b
    else:  # mLSTM or Gated DeltaNet, chunkwise
        heads, chunk = mixer.n_heads, mixer.chunk_size
        if hasattr(mixer, "qk_dim"):
            states = heads * mixer.qk_dim * mixer.v_dim / chunk
            inner += 2 * h + 4 * h + 2 * heads + states  # q, k, v; cell out, normed, gate, product; i, f
        else:
            states = heads * mixer.head_dim**2 / chunk
            inner += 6 * h + 4 * h + 2 * heads + states  # q|k|v before and after the conv; out, normed, gate, product
        if device == "cpu":
            inner += 4 * heads * chunk
    return (outer / t if sp else outer) + inner / t


def _norms_and_mlp(cfg: Config, device: str) -> tuple[float, float]:
    """Elements per token the two norms and the SwiGLU MLP of a block save: in PyTorch each norm its input,
    x·rstd and output (the next projection's input), the MLP gate|up, silu(gate) and the product
    (`down`'s input); on CPU in fp32 under model.kernels=auto (where kernels/dispatch.py picks them)
    their C forms (kernels/cpu_fused.py) save no x·rstd and no silu(gate), only 1/rms per row."""
    h, f = cfg.model.d_model, cfg.model.ffn_hidden_size()
    if device == "cpu" and _dtype_bytes(cfg) == 4 and cfg.model.kernels == "auto":
        return 4 * h + 2, 3 * f
    return 6 * h, 4 * f


def _mixer_inner(cfg: Config, block, layout: Layout, device: str) -> float:
    """The part of block_activation_elements that is the mixer's own (what selective recomputation drops)."""
    t = layout.tensor
    outer, mlp = _norms_and_mlp(cfg, device)
    return (
        block_activation_elements(cfg, block, layout, device) - outer / (t if layout.sequence_parallel else 1) - mlp / t
    )


def memory_bytes(cfg: Config, model: Decoder, layout: Layout, device: str = "cuda") -> dict[str, float]:
    """Bytes per GPU (on the fullest rank) by part; "total" sums them."""
    b = _dtype_bytes(cfg)
    psi, stage_blocks = rank_parameters(model, layout)
    dp, zero = layout.data, layout.zero_stage
    out = {"weights": float(psi * b)}
    if zero == 0:
        out["gradients"] = float(psi * (b if b == 4 else 4 + b))
        out["optimizer"] = float(psi * (8 if b == 4 else 12))
    else:
        out["gradients"] = psi * (b if zero == 1 else b / dp) + psi * 4 / dp
        out["optimizer"] = psi * 12 / dp

    tokens = layout.micro_batch * cfg.data.seq_len
    kinds = model.layer_types
    saved = sorted(
        (
            (block_activation_elements(cfg, blk, layout, device), _mixer_inner(cfg, blk, layout, device), k)
            for blk, k in zip(model.blocks, kinds)
        ),
        reverse=True,
    )[:stage_blocks]  # the fullest stage's blocks
    recomputed = 0.0  # one block's (or mixer's) activations, made again in the backward pass
    if layout.recompute == "full":
        layer_elements = stage_blocks * cfg.model.d_model / (layout.tensor if layout.sequence_parallel else 1)
        recomputed = saved[0][0]
    elif layout.recompute == "selective":
        names = set(cfg.parallel.recompute_mixers)
        layer_elements = sum(full - (mixer if k in names else 0.0) for full, mixer, k in saved)
        recomputed = max((mixer for _, mixer, k in saved if k in names), default=0.0)
    else:
        layer_elements = sum(full for full, _, _ in saved)
    in_flight = min(layout.pipeline, layout.grad_accum) if layout.pipeline > 1 else 1
    out["activations"] = layer_elements * tokens * b * in_flight
    if recomputed:
        out["recomputed"] = recomputed * tokens * b

    vocab = cfg.model.vocab_size / layout.tensor
    chunk = min(LOSS_CHUNK_TOKENS, tokens)
    d = cfg.model.d_model
    out["logits"] = 4 * (chunk * vocab + vocab * d + tokens * d / layout.tensor)
    if device == "cpu" and cfg.model.kernels != "auto":
        tiles = [
            3 * (cfg.model.attention if k == "attention" else cfg.model.swa).block_size
            for k in kinds
            if k in ("attention", "swa")
        ]
        if tiles:  # the reference op's score tiles of block × keys per head, fp32
            keys = cfg.data.seq_len
            out["workspace"] = max(tiles) * layout.micro_batch * cfg.model.n_heads / layout.tensor * keys * 4
    if zero >= 1:
        out["buffers"] = float(min(DEEPSPEED_BUCKET, psi) * b)
    # On top of what is always held and the activations, the peak is the largest of: the loss's
    # chunk of logits (end of the forward pass), or in the backward pass the gradients with the
    # attention tiles, and with the block being recomputed.
    static = out["weights"] + out["optimizer"] + out.get("buffers", 0.0)
    backward = out["gradients"] + out.get("workspace", 0.0) + out.get("recomputed", 0.0)
    held = static + out["activations"] + max(out["logits"], backward)
    out["allowance"] = FRAGMENTATION * held
    out["total"] = held + out["allowance"]
    return out
