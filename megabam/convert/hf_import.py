"""`megabam convert from-hf DIR OUT`: a Hugging Face folder as a megabam consolidated folder.

A megabam export (`to-hf`) comes back bit for bit: its weights under the Decoder's names, with the
run's config and metadata it carries. transformers' LlamaForCausalLM comes in as RoPE attention
layers with its grouped-query heads (the mapping is `_llama`'s), xLSTMForCausalLM as mLSTM layers
(`_xlstm`'s). OUT is a consolidated folder
(megabam/checkpoint/consolidated.py): `megabam train CONFIG train.init_from=OUT` continues pretraining
from it (the optimizer, schedule and data start fresh; the optimizer state does not travel through
an export), and `megabam eval` and `convert to-hf` read it as they read any consolidated folder.
"""

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megabam.checkpoint.consolidated import FORMAT, MARKER, Consolidated
from megabam.checkpoint.safetensors_io import read_model, weight_files, write_model
from megabam.checkpoint.store import META_FILE, CheckpointError, CheckpointMeta
from megabam.config import Config, ConfigError, load_config
from megabam.config.loader import save_config
from megabam.convert.hf_export import CONFIG_FILE, PREFIX
from megabam.data.errors import DataError
from megabam.data.tokenizer import copy_tokenizer, load_tokenizer, tokenizer_in
from megabam.model import Decoder
from megabam.staging import check_output, staged_folder


@dataclass
class Source:
    """What an importable folder gives: the megabam config, the Decoder's tensors by name (read one at a
    time), the metadata to carry and the tokenizer (None when the folder has no sentencepiece model)."""

    config: Config
    fetch: Callable[[str], torch.Tensor]
    meta: CheckpointMeta
    tokenizer: Path | None
    what: str


def from_hf(folder: Path, out: Path, overwrite: bool = False) -> list[str]:
    start = time.perf_counter()
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(folder / "config.json", None, f"not readable as JSON ({e})") from None
    kind = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    readers = {"megabam": _megabam_export, "llama": _llama, "xlstm": _xlstm}
    if kind not in readers:
        raise CheckpointError(
            folder / "config.json", None, f"model_type {kind!r}; from-hf imports {', '.join(sorted(readers))} models"
        )
    check_output(out, overwrite, folder)
    try:
        source = readers[kind](folder, hf_config)
    except CheckpointError:
        raise
    except KeyError as e:  # a config.json written by hand or by another tool
        raise CheckpointError(
            folder / "config.json", None, f"has no {e.args[0]!r}, which a {kind} config needs"
        ) from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(folder / "config.json", None, f"a value of the wrong type or range ({e})") from None
    tokenizer = None
    if source.tokenizer is not None:  # checked before anything is written
        try:
            tokenizer = load_tokenizer(source.tokenizer, source.config.model.vocab_size)
        except DataError as e:
            raise CheckpointError(folder, None, f"its tokenizer cannot be used ({e})") from None
        if kind != "megabam":  # an imported model's config points at its tokenizer (an export keeps its own)
            source.config.data.tokenizer = str(out.absolute() / tokenizer.file_name)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Decoder(source.config.model).state_dict().items()}
    for name, shape in shapes.items():  # every tensor there and of its shape before anything is written
        found = tuple(source.fetch(name, shape_only=True))
        if found != shape:
            raise CheckpointError(folder, None, f"{name} would have shape {list(found)}, the model {list(shape)}")
    dtype = source.fetch(next(iter(shapes))).dtype
    with staged_folder(out, replace=overwrite) as tmp:
        files = write_model(tmp, list(shapes.items()), dtype, source.fetch, 5 * 10**9, desc="from-hf")
        save_config(source.config, tmp / "config.yaml")
        copied = copy_tokenizer(tokenizer, tmp).name if tokenizer is not None else ""
        meta = source.meta if source.meta.tokenizer else dataclasses.replace(source.meta, tokenizer=copied)
        (tmp / META_FILE).write_text(meta.to_json())
        marker = {"format": FORMAT, "version": 1, "source": str(folder), "step": source.meta.step}
        marker |= {"dtype": {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))}
        marker |= {"imported_from": kind, "weights": files}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    lines = [f"imported {folder} ({source.what}) into {out} in {time.perf_counter() - start:.1f} s"]
    if tokenizer is None:
        lines.append("no tokenizer.model or tokenizer.json there: prepare the data with the model's own tokenizer")
        lines.append(f"continue pretraining: megabam train CONFIG train.init_from={out} (the optimizer starts fresh)")
        return lines
    data = out / "data"
    return lines + [
        f"continue pretraining: megabam data prepare CORPUS --tokenizer {out / tokenizer.file_name} --out {data} "
        f"--seq-len {source.config.data.seq_len}",
        f"  then megabam train {out / 'config.yaml'} data.source=mds 'data.streams=[{{path: {data}}}]' "
        f"train.init_from={out} (the optimizer starts fresh)",
    ]


def _tensors(folder: Path) -> Callable:
    """get(key, shape_only=False) over a folder's safetensors files (each opened per read)."""
    from safetensors import SafetensorError, safe_open

    where: dict[str, str] = {}
    try:
        for file in weight_files(folder):
            with safe_open(folder / file, "pt") as f:
                where.update({key: file for key in f.keys()})
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(folder, None, f"weights not readable ({str(e).splitlines()[0]})") from None

    def get(key: str, shape_only: bool = False):
        if key not in where:
            raise CheckpointError(folder, None, f"has no tensor {key}")
        with safe_open(folder / where[key], "pt") as f:
            return f.get_slice(key).get_shape() if shape_only else f.get_tensor(key)

    return get


def _fused(parts: list, shape_only: bool):
    """Tensors stacked along their rows into one of megabam's fused weights, or the shape it would have."""
    if shape_only:
        return (sum(p[0] for p in parts), *parts[0][1:])
    return torch.cat(parts)


def _megabam_export(folder: Path, hf_config: dict) -> Source:
    try:
        config = load_config(folder / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(e.source, e.key, e.message) from None
    get = _tensors(folder)
    meta = CheckpointMeta.read(folder / META_FILE)
    fetch = lambda name, shape_only=False: get(PREFIX + name, shape_only)  # noqa: E731
    # its sentencepiece model if it was trained with one (tokenizer.json beside it is a conversion)
    return Source(config, fetch, meta, tokenizer_in(folder), f"megabam export of step {meta.step}")


def _llama(folder: Path, c: dict) -> Source:
    """LlamaForCausalLM as megabam RoPE attention layers (grouped-query heads kept, no SSMax, no prior).

    transformers' Llama rotates the halves (x[k], x[k + D/2]) of each head; megabam rotates the pairs
    (x[2k], x[2k+1]) with the same frequencies. So each q and k head's rows are interleaved
    (megabam row 2k = Llama row k, row 2k+1 = row k + D/2); q·k is unchanged, v and the rest map as
    they are, [q | k | v] and [gate | up] fused."""
    d, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or d // heads
    refusals = [
        (head_dim != d // heads, f"head_dim {head_dim} is not hidden_size / num_attention_heads"),
        (bool(c.get("attention_bias")), "attention_bias is set (megabam's projections have none)"),
        (bool(c.get("mlp_bias")), "mlp_bias is set (megabam's MLP has none)"),
        (c.get("rope_scaling") is not None, f"rope_scaling {c.get('rope_scaling')!r} (megabam has plain RoPE)"),
        (c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')!r} (megabam's MLP is SwiGLU)"),
    ]
    for refused, why in refusals:
        if refused:
            raise CheckpointError(folder / "config.json", None, why)
    rope_theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    overrides = [
        f"model.vocab_size={c['vocab_size']}",
        f"model.d_model={d}",
        f"model.n_layers={c['num_hidden_layers']}",
        f"model.n_heads={heads}",
        f"model.attention.kv_heads={kv}",
        "model.layer_pattern=[attention]",
        "model.attention.positional=rope",
        "model.attention.ssmax=false",
        f"model.attention.rope_theta={rope_theta}",
        f"model.ffn_hidden={c['intermediate_size']}",
        f"model.norm_eps={c.get('rms_norm_eps', 1e-6)}",
        f"model.tie_embeddings={str(bool(c.get('tie_word_embeddings', False))).lower()}",
    ]
    try:
        config = load_config(None, overrides)
    except ConfigError as e:
        raise CheckpointError(folder / "config.json", None, str(e)) from None
    get = _tensors(folder)
    # megabam row 2k + j (j = 0, 1) of a head is Llama row k + j·D/2
    interleave = torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)

    def rope_rows(w: torch.Tensor, n: int) -> torch.Tensor:
        return w.view(n, head_dim, -1)[:, interleave].reshape(n * head_dim, -1)

    def fetch(name: str, shape_only: bool = False):
        """The Decoder's tensor `name` (or, shape_only, its shape: nothing read but the headers)."""
        read = lambda key: get(key, shape_only)  # noqa: E731
        rotated = (lambda w, n: w) if shape_only else rope_rows  # the rotation keeps the shape
        parts = name.split(".")
        if name == "embed.weight":
            return read("model.embed_tokens.weight")
        if name == "norm.weight":
            return read("model.norm.weight")
        if name == "lm_head.weight":
            return read("lm_head.weight")
        i, rest = parts[1], ".".join(parts[2:])
        layer = f"model.layers.{i}."
        if rest == "mixer_norm.weight":
            return read(layer + "input_layernorm.weight")
        if rest == "mlp_norm.weight":
            return read(layer + "post_attention_layernorm.weight")
        if rest == "mixer.qkv.weight":
            q = rotated(read(layer + "self_attn.q_proj.weight"), heads)
            k = rotated(read(layer + "self_attn.k_proj.weight"), kv)
            return _fused([q, k, read(layer + "self_attn.v_proj.weight")], shape_only)
        if rest == "mixer.out.weight":
            return read(layer + "self_attn.o_proj.weight")
        if rest == "mlp.gate_up.weight":
            return _fused([read(layer + "mlp.gate_proj.weight"), read(layer + "mlp.up_proj.weight")], shape_only)
        if rest == "mlp.down.weight":
            return read(layer + "mlp.down_proj.weight")
        raise CheckpointError(folder, None, f"no Llama tensor maps to {name}")

    meta = CheckpointMeta(0, 0, 0, {}, dataclasses.asdict(config), 0, "", None, None)
    tokenizer = tokenizer_in(folder)
    return Source(config, fetch, meta, tokenizer, f"LlamaForCausalLM, {c['num_hidden_layers']} layers")


def _xlstm(folder: Path, c: dict) -> Source:
    """xLSTMForCausalLM (xLSTM-7B's form) as megabam mLSTM layers: q, k of d/2 and v of d, soft-capped
    scalar gates with biases, the mean-centred per-head norm (model.mlstm.head_norm=layer), σ output
    gate, SwiGLU feed-forward, RMS norms, soft-capped output logits. What megabam cannot express
    exactly is refused, naming it."""
    d, heads = c["hidden_size"], c["num_heads"]
    layers = c.get("num_blocks") or c["num_hidden_layers"]
    refusals = [
        (c.get("qk_dim_factor", 0.5) != 0.5, f"qk_dim_factor {c.get('qk_dim_factor')} (megabam's q, k are d/2)"),
        (c.get("v_dim_factor", 1.0) != 1.0, f"v_dim_factor {c.get('v_dim_factor')} (megabam's v is d)"),
        (bool(c.get("use_bias")), "use_bias is set (megabam's projections and norms have none)"),
        (not c.get("add_out_norm", True), "add_out_norm is false (megabam always has the final norm)"),
        (c.get("embedding_dim", d) not in (None, d), f"embedding_dim {c.get('embedding_dim')} is not hidden_size"),
        # transformers 5.24 cannot build a fused model (its weight init fails), so no import of one is tested
        (c.get("weight_mode", "single") != "single", f"weight_mode {c.get('weight_mode')!r} (single is imported)"),
    ]
    for refused, why in refusals:
        if refused:
            raise CheckpointError(folder / "config.json", None, why)
    cap = c.get("output_logit_soft_cap")
    get = _tensors(folder)
    ffn = get("backbone.blocks.0.ffn.proj_down.weight", shape_only=True)[1]  # d·ffn_proj_factor, rounded up
    overrides = [
        f"model.vocab_size={c['vocab_size']}",
        f"model.d_model={d}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        "model.layer_pattern=[mlstm]",
        f"model.ffn_hidden={ffn}",
        f"model.norm_eps={c.get('norm_eps', 1e-6)}",
        f"model.tie_embeddings={str(bool(c.get('tie_word_embeddings', False))).lower()}",
        f"model.logit_soft_cap={'null' if cap is None else cap}",
        f"model.mlstm.gate_soft_cap={c.get('gate_soft_cap', 15.0)}",
        f"model.mlstm.eps={c.get('eps', 1e-6)}",
        "model.mlstm.head_norm=layer",
        # xLSTM-7B's layer, whatever megabam's defaults: q, k at d/2, no convolution, its gate init
        "model.mlstm.qk_dim_factor=0.5",
        "model.mlstm.conv_size=0",
        f"model.mlstm.igate_bias_init={c.get('igate_bias_init', -10.0)}",
    ]
    try:
        config = load_config(None, overrides)
    except ConfigError as e:
        raise CheckpointError(folder / "config.json", None, str(e)) from None
    mixer = {  # megabam's name in an mLSTM layer → xLSTM's
        "q.weight": "q.weight",
        "k.weight": "k.weight",
        "v.weight": "v.weight",
        "ogate.weight": "ogate_preact.weight",
        **{f"{g}gate.{p}": f"{g}gate_preact.{p}" for g in "if" for p in ("weight", "bias")},
        "norm_weight": "multihead_norm.weight",
        "out.weight": "out_proj.weight",
    }

    def fetch(name: str, shape_only: bool = False):
        """The Decoder's tensor `name` (or, shape_only, its shape: nothing read but the headers)."""
        read = lambda key: get(key, shape_only)  # noqa: E731
        whole = {"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.out_norm.weight"}
        if name in whole or name == "lm_head.weight":
            return read(whole.get(name, name))
        parts = name.split(".")
        block, rest = f"backbone.blocks.{parts[1]}.", ".".join(parts[2:])
        if rest == "mixer_norm.weight":
            return read(block + "norm_mlstm.weight")
        if rest == "mlp_norm.weight":
            return read(block + "norm_ffn.weight")
        if rest == "mlp.gate_up.weight":
            return _fused([read(block + "ffn.proj_up_gate.weight"), read(block + "ffn.proj_up.weight")], shape_only)
        if rest == "mlp.down.weight":
            return read(block + "ffn.proj_down.weight")
        if rest.startswith("mixer.") and rest[len("mixer.") :] in mixer:
            return read(block + "mlstm_layer." + mixer[rest[len("mixer.") :]])
        raise CheckpointError(folder, None, f"no xLSTM tensor maps to {name}")

    meta = CheckpointMeta(0, 0, 0, {}, dataclasses.asdict(config), 0, "", None, None)
    tokenizer = tokenizer_in(folder)
    return Source(config, fetch, meta, tokenizer, f"xLSTMForCausalLM, {layers} mLSTM layers")


def is_export(folder: Path) -> bool:
    """Whether `folder` is a megabam export (`convert to-hf`)."""
    return (folder / "config.json").is_file() and (folder / CONFIG_FILE).is_file()


def read_export(folder: Path) -> Consolidated:
    """The one-process model (float32), config, metadata and tokenizer of a megabam export."""
    from safetensors import SafetensorError

    try:
        config = load_config(folder / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(e.source, e.key, e.message) from None
    model = Decoder(config.model)
    try:
        state = {k.removeprefix(PREFIX): v.float() for k, v in read_model(folder).items()}
        model.load_state_dict(state)
    except (OSError, RuntimeError, KeyError, ValueError, SafetensorError) as e:
        raise CheckpointError(
            folder, None, f"weights do not fit its {CONFIG_FILE} ({str(e).splitlines()[0]})"
        ) from None
    return Consolidated(model, config, CheckpointMeta.read(folder / META_FILE), tokenizer_in(folder))
