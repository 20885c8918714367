"""Pipeline parallelism (DeepSpeed's pipeline engine, 1F1B) on CPU/gloo with real processes, against
the single-process math.

Each rank runs the real path: `init_distributed`, `build_topology`, `build_engine` (which splits the
model into stages) and the engine's `step`. Every rank also builds the PP=1 model from the
same seed and trains it alone with plain PyTorch (AdamW groups and schedule from megabam.train.optim,
micro-batch losses averaged, global-norm clipping): that is the reference. Tolerances are for fp32.
"""

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn

from megabam.config import ConfigError, load_config
from megabam.model import Decoder
from megabam.parallel.pipeline import BlockStage, EmbeddingStage, FinalNormStage, HeadStage
from megabam.parallel.topology import build_topology
from megabam.train.engine import build_engine
from megabam.train.optim import PLACEHOLDER, build_optimizer, build_scheduler

V, SEQ, MICRO, ACCUM, STEPS = 64, 32, 2, 3, 3
LOSS_RTOL = 1e-5  # relative, per step; measured ≤ 8.6e-8
PARAM_ATOL = 1e-5  # absolute, per parameter element after the steps; measured ≤ 3.5e-7
MODEL = [
    f"model.vocab_size={V}",
    "model.d_model=32",
    "model.n_layers=4",
    "model.n_heads=4",
    f"data.seq_len={SEQ}",
    "model.attention.block_size=8",
    "model.swa.block_size=8",
    "model.swa.window=16",
    "window.windows=[8, 16]",
    "model.mlstm.chunk_size=8",
    "model.gated_deltanet.chunk_size=8",
    f"train.micro_batch_size={MICRO}",
    f"train.grad_accum={ACCUM}",
    f"train.steps={STEPS}",
    "schedule.warmup_steps=1",
    "optim.lr=1e-2",
    "optim.grad_clip=0.5",
]  # clipping active: the gradient norm over the stages must be right
BAM = [
    "model.layer_pattern=[attention]",
    "model.attention.positional=ggd_bam",
    "model.attention.bam.init=spread",
    "model.attention.ssmax=true",
]
SWAX = ["model.layer_pattern=[SM]"]


# --- config validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,key,message",
    [
        (
            ["parallel.pipeline=2", "parallel.zero_stage=2"],
            "parallel.zero_stage",
            "stage 2 cannot be combined with pipeline parallelism; use 1",
        ),
        (
            ["parallel.pipeline=2", "parallel.zero_stage=0", "train.max_bad_steps=0"],
            "parallel.zero_stage",
            "stage 0 cannot be combined with pipeline parallelism; use 1",
        ),
        (
            ["parallel.pipeline=4", "model.n_layers=2", "parallel.zero_stage=1"],
            "parallel.pipeline",
            "4 stages but only model.n_layers=2 layers",
        ),
        (
            ["parallel.pipeline=2", "model.n_layers=4", "parallel.pipeline_boundaries=[1, 2]"],
            "parallel.pipeline_boundaries",
            "needs parallel.pipeline − 1 = 1 indices, got 2",
        ),
        (
            ["parallel.pipeline=3", "model.n_layers=4", "parallel.pipeline_boundaries=[2, 2]"],
            "parallel.pipeline_boundaries",
            "[2, 2] must increase strictly within 1..model.n_layers−1=3",
        ),
        (
            ["parallel.pipeline=2", "model.n_layers=4", "parallel.pipeline_boundaries=[4]"],
            "parallel.pipeline_boundaries",
            "[4] must increase strictly within 1..model.n_layers−1=3",
        ),
        (["parallel.pipeline_boundaries=[1]"], "parallel.pipeline_boundaries", "given but parallel.pipeline is 1"),
        (
            ["parallel.pipeline=2", "model.attention.bam.shared_across_layers=true"],
            "model.attention.bam.shared_across_layers",
            "a prior shared across layers cannot be split over pipeline stages; set it false",
        ),
    ],
    ids=[
        "zero2",
        "zero0",
        "stages",
        "bounds_count",
        "bounds_order",
        "bounds_range",
        "bounds_without_pp",
        "shared_prior",
    ],
)
def test_pipeline_settings_that_cannot_work_are_one_line_errors(overrides, key, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key
    assert str(err.value).endswith(message) and "\n" not in str(err.value)


def test_pipeline_settings_that_work_are_accepted():
    cfg = load_config(None, ["parallel.pipeline=2", "model.n_layers=4", "parallel.pipeline_boundaries=[3]"])
    assert (cfg.parallel.pipeline, cfg.parallel.pipeline_boundaries) == (2, [3])


# --- training against the single-process model ------------------------------------------------------


def _micro_batches(step: int) -> list[dict]:
    """ACCUM micro-batches of tokens, labels and two packed documents per row; every rank draws the same."""
    out = []
    for m in range(ACCUM):
        g = torch.Generator().manual_seed(1000 + 10 * step + m)
        ids, labels = torch.randint(0, V, (2, MICRO, SEQ), generator=g)
        doc_ids = (torch.arange(SEQ) >= 13).long().expand(MICRO, SEQ).clone()
        out.append({"input_ids": ids, "labels": labels, "doc_ids": doc_ids})
    return out


def _reference_step(model, optimizer, scheduler, batches, window, clip) -> tuple[float, float]:
    """One step of the PP=1 model in plain PyTorch: (mean loss over the micro-batches, gradient norm)."""
    optimizer.zero_grad()
    total = 0.0
    for b in batches:
        # The loss from the logits, as the pipeline's last stage computes it (model.output.loss), not the
        # chunked loss straight from the hidden states a single process trains with: equal in exact
        # arithmetic, but AdamW would turn their rounding differences into parameter differences
        # above PARAM_ATOL within these steps.
        logits = model(b["input_ids"], doc_ids=b["doc_ids"], window=window)
        loss = model.output.loss(logits, b["labels"]) / len(batches)
        loss.backward()
        total += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    optimizer.step()
    scheduler.step()
    return total, norm


def _local_parameters(module) -> dict[str, torch.Tensor]:
    """This stage's parameters under the names they have in a whole `Decoder`."""
    out = {}
    for f in module.forward_funcs:
        if isinstance(f, BlockStage):
            out.update({f"blocks.{f.index}.{n}": p for n, p in f.block.named_parameters()})
        elif isinstance(f, EmbeddingStage):
            out["embed.weight"] = f.embed.weight
        elif isinstance(f, FinalNormStage):
            out["norm.weight"] = f.norm.weight
        elif isinstance(f, HeadStage):
            out["lm_head.weight"] = f.lm_head.weight
    for tied in module.tied_modules.values():
        out["embed.weight"] = tied.embed.weight
    return out


def _check_against_single(overrides: list[str], window) -> None:
    cfg = load_config(None, MODEL + overrides)
    topology = build_topology(cfg.parallel.tensor, cfg.parallel.pipeline)
    engine = build_engine(cfg, topology)
    torch.manual_seed(cfg.run.seed)
    reference = Decoder(cfg.model)
    ref_opt = build_optimizer(reference, cfg.optim)
    ref_sched = build_scheduler(ref_opt, cfg.schedule, cfg.train.steps)
    assert engine.params == reference.num_params()
    worst, worst_param = 0.0, 0.0
    for step in range(STEPS):
        batches = _micro_batches(step)
        loss = engine.step(batches, window).item() / ACCUM
        want, want_norm = _reference_step(reference, ref_opt, ref_sched, batches, window, cfg.optim.grad_clip)
        rel = abs(loss - want) / abs(want)
        assert rel <= LOSS_RTOL, (step, loss, want)
        assert engine.deepspeed.get_global_grad_norm() == pytest.approx(want_norm, rel=1e-5), step
        worst = max(worst, rel)
    # Greedy predictions through the stages (passkey scoring) are the whole model's, on every rank.
    ids = torch.randint(0, V, (1, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(engine.predict(ids), reference(ids).argmax(-1))
    # Per-head values logged by rank 0 cover the layers of every stage.
    logged_layers = {int(key.split("/")[1][len("layer") :]) for key in engine.head_parameters()}
    assert logged_layers == {i for i, b in enumerate(reference.blocks) if getattr(b.mixer, "ssmax_s", None) is not None}
    if topology.tp_size == 1:
        # Every parameter this stage holds equals the reference's after the steps; both stages hold
        # the tied embedding, so the two copies also equal each other (they stayed tied).
        local = _local_parameters(engine.deepspeed.module)
        first, last = topology.pp_rank == 0, topology.pp_rank == topology.pp_size - 1
        assert ("embed.weight" in local) == (first or (last and cfg.model.tie_embeddings))
        assert ("lm_head.weight" in local) == (last and not cfg.model.tie_embeddings)
        ref = dict(reference.named_parameters())
        held = dict(engine.deepspeed.module.named_parameters())
        placeholders = {k: p for k, p in held.items() if k.startswith(PLACEHOLDER)}
        assert all(not p.any() for p in placeholders.values())  # an empty group's stand-in never moves
        assert len(local) == sum(p.numel() > 0 for p in held.values()) - len(placeholders), "a parameter unchecked"
        for name, p in local.items():
            diff = (p.detach() - ref[name].detach()).abs().max().item()
            assert diff <= PARAM_ATOL, (name, diff)
            worst_param = max(worst_param, diff)
    if dist.get_rank() == 0:  # shown with pytest -s: the measured tolerance
        params = f", max parameter abs diff {worst_param:.2e} (rank 0's stage)" if topology.tp_size == 1 else ""
        print(f"PP vs PP=1 {overrides}: max loss rel diff {worst:.2e}{params}", flush=True)


def _check_models(variants) -> None:
    for overrides, window in variants:
        _check_against_single(overrides, window)


def test_two_pipeline_stages_match_one_process_for_bam_and_swax():
    spawn(
        2,
        _check_models,
        [
            (BAM + ["parallel.pipeline=2"], None),
            (BAM + ["parallel.pipeline=2", "model.tie_embeddings=false"], None),  # the LM head as a stage of its own
            # explicit stage boundary, a window per step, selective recomputation inside the stages
            (SWAX + ["parallel.pipeline=2", "parallel.pipeline_boundaries=[1]", "parallel.recompute=selective"], 8),
            # an mLSTM-only last stage: no prior or SSMax parameters there (placeholders keep the stages'
            # optimizer groups equal; without them DeepSpeed's per-group norm all-reduce hangs)
            (BAM + ["model.layer_pattern=[AAMM]", "parallel.pipeline=2", "parallel.pipeline_boundaries=[2]"], None),
        ],
    )


def test_two_tensor_by_two_pipeline_ranks_match_one_process():
    spawn(
        4,
        _check_models,
        [
            (BAM + ["parallel.pipeline=2", "parallel.tensor=2"], None),
            (SWAX + ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true"], 16),
        ],
    )
