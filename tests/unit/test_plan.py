"""The planner (megabam/plan): parameter counts against a hand count for every shipped config and the
built model for the small ones, FLOPs per token against a hand count, the verdicts on the 7B@16k
config's stated hardware, and the command's output and errors."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megabam.cli import main
from megabam.config import load_config
from megabam.model import Decoder
from megabam.plan.counts import forward_flops_by_component, meta_model, params_by_component, window_draws
from megabam.plan.hardware import GPUS
from megabam.plan.planner import GIB, config_layout, estimate, plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (ROOT / "yaml_configs").glob("*.yaml"))


def hand_count(cfg) -> dict[str, int]:
    """Parameters per component written out from the architecture, layer by layer."""
    m = cfg.model
    d, V, L, H, f = m.d_model, m.vocab_size, m.n_layers, m.n_heads, m.ffn_hidden_size()
    counts = {"embedding": V * d, "norms": 2 * d * L + d, "mlp": 3 * d * f * L}
    if not m.tie_embeddings:
        counts["head"] = V * d
    priors = 0
    for kind in m.layer_types():
        if kind in ("attention", "swa"):
            a = m.attention if kind == "attention" else m.swa
            kv = (a.kv_heads or H) * (d // H)
            counts[kind] = counts.get(kind, 0) + d * (d + 2 * kv) + d * d
            if a.ssmax:
                counts["ssmax"] = counts.get("ssmax", 0) + H
            if a.positional == "ggd_bam":
                priors += 3 * H  # θ_α, θ_β, θ_μ per head
        elif kind == "mlstm":
            h, qk, c = m.mlstm.n_heads or H, round(d * m.mlstm.qk_dim_factor), m.mlstm.conv_size
            counts[kind] = counts.get(kind, 0) + 2 * d * qk + 2 * qk * c + 3 * d * d + 2 * (d * h + h) + d
        else:
            h, c = m.gated_deltanet.n_heads or H, m.gated_deltanet.conv_size
            counts[kind] = counts.get(kind, 0) + 3 * d * d + 3 * d * c + 2 * d * h + 2 * d * d + 2 * h + d
    if priors:
        shared = m.attention.bam.shared_across_layers
        counts["bam_prior"] = 3 * H if shared else priors
    return counts


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_by_component_match_a_hand_count_for_every_config(name):
    cfg = load_config(ROOT / "yaml_configs" / name)
    assert params_by_component(meta_model(cfg)) == hand_count(cfg)


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "swax_tiny_cpu.yaml", "bam_120m.yaml"])
def test_parameters_equal_the_built_models(name):
    cfg = load_config(ROOT / "yaml_configs" / name)
    built = Decoder(cfg.model)  # on the CPU, initialised
    assert sum(params_by_component(meta_model(cfg)).values()) == sum(p.numel() for p in built.parameters())


def test_forward_flops_per_token_match_a_hand_count():
    cfg = load_config(ROOT / "yaml_configs" / "tiny_cpu.yaml")
    m, N = cfg.model, cfg.data.seq_len
    d, V, L, H, f = m.d_model, m.vocab_size, m.n_layers, m.n_heads, m.ffn_hidden_size()
    D = d // H
    per_layer = 2 * (3 * d * d + d * d) + 2 * 3 * d * f  # q|k|v and out; gate|up and down
    per_layer += 2 * (2 * H * D * N / 2)  # q·k and p·v over N/2 keys on average
    per_layer += H * N / 2 + H * D  # the prior's add per logit, SSMax's query scale
    hand = L * per_layer + 2 * V * d  # the tied head's matmul
    flops = forward_flops_by_component(meta_model(cfg), N, window_draws(cfg))
    assert sum(flops.values()) == pytest.approx(hand, rel=1e-12)


def test_a_causal_window_costs_n_w_minus_half_w_squared():
    cfg = load_config(ROOT / "yaml_configs" / "swax_tiny_cpu.yaml", ["data.seq_len=1024"])
    m, N = cfg.model, cfg.data.seq_len
    H, D = m.n_heads, m.d_model // m.n_heads
    draws = window_draws(cfg)
    assert sum(p for _, p in draws) == pytest.approx(1.0)
    flops = forward_flops_by_component(meta_model(cfg), N, draws)
    swa_layers = m.layer_types().count("swa")
    expected = swa_layers * sum(p * 2 * H * D * (N * w - w * w / 2) / N for w, p in draws)
    assert flops["swa.scores"] == pytest.approx(expected, rel=1e-12)


def test_noncausal_flops_count_every_masked_triangle_whole():
    """causal=False, the convention of published MFU: full attention over all N keys (the causal count's
    N/2), a window over w keys (causal: w − w²/2N), the recurrent cells over whole chunks."""
    cfg = load_config(ROOT / "yaml_configs" / "tiny_cpu.yaml")
    m, N = cfg.model, cfg.data.seq_len
    H, D = m.n_heads, m.d_model // m.n_heads
    model = meta_model(cfg)
    causal, full = (forward_flops_by_component(model, N, causal=c) for c in (True, False))
    extra = m.n_layers * (2 * 2 * H * D + H) * (N - N / 2)  # q·k, p·v and the prior's add over N/2 more keys
    assert sum(full.values()) - sum(causal.values()) == pytest.approx(extra, rel=1e-12)
    cfg = load_config(ROOT / "yaml_configs" / "swax_tiny_cpu.yaml", ["data.seq_len=1024"])
    model, N, w = meta_model(cfg), cfg.data.seq_len, 128
    causal, full = (forward_flops_by_component(model, N, [(w, 1.0)], causal=c) for c in (True, False))
    assert full["swa.scores"] / causal["swa.scores"] == pytest.approx(w / (w - w * w / (2 * N)), rel=1e-12)
    assert full["mlstm.intra_chunk"] == 2 * causal["mlstm.intra_chunk"]
    assert full["mlstm.inter_chunk"] == causal["mlstm.inter_chunk"]


def test_the_7b_config_fits_its_stated_hardware_and_an_oversized_one_does_not():
    cfg = load_config(ROOT / "yaml_configs" / "swax_7b_16k.yaml")
    h100 = GPUS["h100-80gb"]
    own = estimate(cfg, meta_model(cfg), config_layout(cfg, 64), h100, 8)
    assert own.fits and own.margin > 10 * GIB
    assert 0.3 < own.mfu < 1.0 and own.tokens_per_s > 0
    plain = load_config(
        ROOT / "yaml_configs" / "swax_7b_16k.yaml",
        ["parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.data=64"],
    )
    assert not estimate(plain, meta_model(plain), config_layout(plain, 64), h100, 8).fits  # no TP at 16k
    wide = load_config(ROOT / "yaml_configs" / "swax_7b_16k.yaml", ["model.n_layers=192"])  # ~28B
    result = plan(wide, h100, 8, 8, top=3)
    assert not result.own.fits
    assert all(e.fits for e in result.best)


@pytest.mark.parametrize(
    "name, gpu, nodes",
    [
        ("bam_120m.yaml", "a100-80gb", 1),
        ("bam_1p1b.yaml", "h100-80gb", 1),
        ("swax_1p4b_16k.yaml", "h100-80gb", 2),
        ("swax_7b_16k.yaml", "h100-80gb", 8),
    ],
)
def test_each_cluster_config_fits_the_hardware_its_header_names(name, gpu, nodes):
    cfg = load_config(ROOT / "yaml_configs" / name)
    assert f"--gpu {gpu} --nodes {nodes}" in (ROOT / "yaml_configs" / name).read_text().replace("\n# ", " ")
    own = estimate(cfg, meta_model(cfg), config_layout(cfg, 8 * nodes), GPUS[gpu], 8)
    assert own.fits, own.memory


def test_recomputation_costs_forward_flops_again():
    cfg = load_config(ROOT / "yaml_configs" / "tiny_cpu.yaml")
    model = meta_model(cfg)
    base = config_layout(cfg, 1)
    flops = [
        estimate(cfg, model, dataclasses.replace(base, recompute=mode), GPUS["h100-80gb"], 8).flops_per_token
        for mode in ("none", "selective", "full")
    ]
    forward = sum(forward_flops_by_component(model, cfg.data.seq_len).values())
    head = forward_flops_by_component(model, cfg.data.seq_len)["head"]
    assert flops[0] == pytest.approx(3 * forward) and flops[2] == pytest.approx(4 * forward - head)
    assert flops[0] < flops[1] < flops[2]


def test_more_recomputation_and_tensor_parallelism_need_less_memory():
    cfg = load_config(ROOT / "yaml_configs" / "swax_1p4b_16k.yaml")
    model = meta_model(cfg)
    base = config_layout(cfg, 16)
    totals = [
        estimate(cfg, model, base.__class__(**{**base.__dict__, **change}), GPUS["h100-80gb"], 8).memory["activations"]
        for change in [{}, {"recompute": "selective"}, {"recompute": "full"}]
    ]
    assert totals[0] > totals[1] > totals[2]


def test_plan_command_prints_tables_and_json_and_names_bad_input(capsys):
    """The command in this process (its entry point, megabam.cli.main; a subprocess costs a torch
    import per call): the table, the JSON and one-line errors with exit code 2."""
    cmd = ["plan", str(ROOT / "yaml_configs" / "bam_120m.yaml")]
    assert main([*cmd, "--gpu", "a100-80gb", "--nodes", "1"]) == 0
    table = capsys.readouterr().out
    assert "config layout TP1 PP1 DP8" in table and ": fits:" in table
    assert main([*cmd, "--gpu", "h100-80gb", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config_layout"]["fits"] and sum(result["parameters"].values()) == 123_587_904
    assert main([*cmd, "model.n_heads=7", "--gpu", "h100-80gb"]) == 2
    bad = capsys.readouterr().err
    assert "model.n_heads" in bad and len(bad.strip().splitlines()) == 1
    assert main([*cmd, "--gpu", "h100-80gb", "--nodes", str(10**9)]) == 2
    assert capsys.readouterr().err.strip().endswith("--nodes: must lie in 1..100,000, got 1,000,000,000")


def test_meta_model_holds_no_memory():
    cfg = load_config(ROOT / "yaml_configs" / "swax_7b_16k.yaml")
    assert all(p.device == torch.device("meta") for p in meta_model(cfg).parameters())


def test_the_megabam_command_starts_without_importing_torch():
    """Its SIGTERM/SIGUSR1 handlers go in before torch is imported (tests/e2e/test_reliability.py
    signals it 1 s after start); the planner and the trainer import torch when they run."""
    code = "import sys, megabam.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_activations_count_the_c_ops_only_where_they_run():
    """On CPU in fp32, mode auto runs the one-pass C norms and SwiGLU product (kernels/cpu_fused.py),
    which save 1/rms per row instead of x·rstd and no silu(gate), and the C attention kernel
    (kernels/bam_attention_cpu.py), which keeps its output and contiguous k, v; mode reference runs the
    PyTorch forms. By hand, per token and block: two norms save h - 1 fewer elements each, the MLP f
    fewer, attention h + 2·kv more."""
    from megabam.plan.memory import block_activation_elements

    counts = {}
    for mode in ("auto", "reference"):
        cfg = load_config(ROOT / "yaml_configs" / "tiny_cpu.yaml", [f"model.kernels={mode}"])
        block = meta_model(cfg).blocks[0]
        counts[mode] = block_activation_elements(cfg, block, config_layout(cfg, 1), "cpu")
    h, f = cfg.model.d_model, cfg.model.ffn_hidden_size()
    kv = block.mixer.kv_heads * block.mixer.head_dim
    assert counts["reference"] - counts["auto"] == 2 * (h - 1) + f - (h + 2 * kv)
