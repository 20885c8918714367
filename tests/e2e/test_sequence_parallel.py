"""Sequence parallelism on CPU/gloo with real processes: TP=2 with SP against TP=2 without it and
against the single-process model, all built from the same seed on every rank (see test_tensor_parallel.py).
"""

import pytest
import torch
import torch.distributed as dist
from helpers.runs import losses, megabam_train
from helpers.spawn import spawn
from helpers.tensor_parallel import (
    BAM,
    GRAD_ATOL,
    LOSS_RTOL,
    SEED,
    SEQ,
    STEPS,
    V,
    count_parameters,
    gather_shards,
    make_batch,
    shard_blocks,
)

from megabam.config import ConfigError, load_config
from megabam.model import Decoder
from megabam.parallel.layout import ParallelLayout
from megabam.parallel.sequence_parallel import apply_sp
from megabam.parallel.tensor_parallel import apply_tp
from megabam.parallel.topology import Topology

# --- config validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallel.sequence_parallel=true"], "needs tensor parallelism: set parallel.tensor > 1"),
        (
            ["parallel.sequence_parallel=true", "parallel.tensor=4", "data.seq_len=1026"],
            "parallel.tensor=4 does not divide data.seq_len=1026",
        ),
        (
            ["parallel.sequence_parallel=true", "parallel.tensor=2", "eval.passkey_lengths=[1024, 1537]"],
            "parallel.tensor=2 does not divide eval.passkey_lengths[1]=1537",
        ),
    ],
    ids=["no_tp", "seq_len", "passkey_length"],
)
def test_sequence_parallel_config_errors_are_one_line_and_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == "parallel.sequence_parallel"
    assert str(err.value).endswith(message) and "\n" not in str(err.value)


def test_sequence_parallel_config_is_accepted_with_splittable_lengths():
    assert not load_config(None, []).parallel.sequence_parallel
    cfg = load_config(
        None,
        [
            "parallel.sequence_parallel=true",
            "parallel.tensor=2",
            "eval.passkey_lengths=[1024, 1537]",
            "eval.passkey_samples=0",
        ],
    )
    assert cfg.parallel.sequence_parallel


# --- whole models: SP against TP and against TP=1 ---------------------------------------------------


def _compare_sp(overrides: list[str], window) -> dict[str, float]:
    """3 AdamW steps of the TP=1, TP=2 and TP=2+SP models from the same seed: losses and gathered
    gradients of every parameter (the replicated norms included) must agree at every step, then the
    logits of the forward and of a streamed prompt chunk. Returns the largest differences of SP seen."""
    topo = Topology(ParallelLayout(tensor=dist.get_world_size()))
    cfg = load_config(
        None,
        [
            f"model.vocab_size={V}",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            f"data.seq_len={SEQ}",
            "model.attention.block_size=8",
            "model.swa.block_size=8",
            "model.swa.window=16",
            "window.windows=[8, 16]",
            "model.mlstm.chunk_size=8",
            "model.gated_deltanet.chunk_size=8",
            *overrides,
        ],
    ).model
    models = []
    for convert in [lambda m: m, lambda m: apply_tp(m, topo), lambda m: apply_sp(apply_tp(m, topo), topo)]:
        torch.manual_seed(SEED)
        models.append(convert(Decoder(cfg)))
    full, tp, sp = models
    assert count_parameters(sp, topo) == full.num_params()
    params = [dict(m.named_parameters()) for m in models]
    assert params[2].keys() == params[0].keys()
    for name, p in params[1].items():  # SP neither adds, drops nor reshards parameters
        assert torch.equal(params[2][name], p) and getattr(params[2][name], "tensor_model_parallel", False) == getattr(
            p, "tensor_model_parallel", False
        ), name
    assert sp.state_dict().keys() == tp.state_dict().keys()  # checkpoints load either way
    compared: set[str] = set()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    worst = {"loss_rel_vs_tp": 0.0, "loss_rel_vs_full": 0.0, "grad_abs_vs_tp": 0.0, "grad_abs_vs_full": 0.0}
    for step in range(STEPS):
        ids, labels, doc_ids = make_batch(step)
        step_losses = []
        for model, opt in zip(models, opts):
            opt.zero_grad()
            loss = model(ids, labels, doc_ids=doc_ids, window=window)
            loss.backward()
            step_losses.append(loss.item())
        for ref, key in [(1, "tp"), (0, "full")]:
            rel = abs(step_losses[2] - step_losses[ref]) / abs(step_losses[ref])
            assert rel <= LOSS_RTOL, (step, key, step_losses)
            worst[f"loss_rel_vs_{key}"] = max(worst[f"loss_rel_vs_{key}"], rel)
        for name, p in full.named_parameters():
            if p.grad is None:
                assert params[1][name].grad is None and params[2][name].grad is None, name
                continue
            compared.add(name)
            blocks = shard_blocks(full, name, topo.tp_size)
            sp_grad = gather_shards(name, params[2][name].grad, topo.tp_group, blocks)
            tp_grad = gather_shards(name, params[1][name].grad, topo.tp_group, blocks)
            for ref_grad, key in [(tp_grad, "tp"), (p.grad, "full")]:
                diff = (sp_grad - ref_grad).abs().max().item()
                assert diff <= GRAD_ATOL, (step, key, name, diff)
                worst[f"grad_abs_vs_{key}"] = max(worst[f"grad_abs_vs_{key}"], diff)
        for opt in opts:
            opt.step()
    # The replicated norms, fed one shard each, are among the gradients compared.
    assert {"norm.weight", "blocks.0.mixer_norm.weight", "blocks.1.mlp_norm.weight"} <= compared
    with torch.no_grad():
        torch.testing.assert_close(
            sp(ids, doc_ids=doc_ids, window=window), full(ids, doc_ids=doc_ids, window=window), rtol=1e-4, atol=1e-5
        )
        assert torch.equal(sp.greedy(ids), full(ids).argmax(-1))
        # A prompt chunk whose length splits over the ranks streams under SP too.
        chunk = ids[:, :20]
        torch.testing.assert_close(
            sp.stream(chunk, window=window)[0], full.stream(chunk, window=window)[0], rtol=1e-4, atol=1e-5
        )
    return worst


def _check(variants) -> None:
    for overrides, window in variants:
        worst = _compare_sp(overrides, window)
        if dist.get_rank() == 0:  # shown with pytest -s: the measured tolerances
            print(f"SP TP=2 {overrides}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()), flush=True)


VARIANTS = [  # BAM with SSMax and an untied head; SWAX [SM] with sinusoidal SWA positions; Gated DeltaNet
    (BAM + ["model.tie_embeddings=false"], None),
    (["model.layer_pattern=[SM]", "model.mlstm.n_heads=2", "model.swa.positional=sinusoidal"], 8),
    (["model.layer_pattern=[GA]"], None),
]


def test_sp_matches_tp_and_tp1_over_three_adamw_steps():
    spawn(2, _check, VARIANTS)


# --- end to end through `megabam train` --------------------------------------------------------------


def test_sequence_parallel_training_matches_one_process(tmp_path, data_cache):
    """TP=2 with SP under torchrun: the logged losses of the single-process run, and the passkey
    scoring at the end (prompts of data.seq_len tokens) runs through the sharded model."""
    run = ["train.steps=3", "train.eval_every=3", "checkpoint.every=3"]
    megabam_train(tmp_path, data_cache, "run.name=tp1", *run)
    megabam_train(
        tmp_path, data_cache, "run.name=sp2", "parallel.tensor=2", "parallel.sequence_parallel=true", *run, nproc=2
    )
    reference, parallel = losses(tmp_path / "tp1"), losses(tmp_path / "sp2")
    assert sorted(parallel) == [1, 2, 3]
    for step in (1, 2, 3):
        assert parallel[step] == pytest.approx(reference[step], rel=LOSS_RTOL), step
    assert "passkey_128" in (tmp_path / "sp2" / "metrics.jsonl").read_text()
