"""The training loop: data → DeepSpeed engine → metrics, evaluation and checkpoints, with auto-resume,
preemption handling and a guard against non-finite steps."""
import itertools
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megabam.config import Config, ConfigError, save_config
from megabam.data.default_dataset import build_default_dataset
from megabam.data.errors import DataError
from megabam.data.loader import build_loader
from megabam.data.passkey import passkey_sample
from megabam.data.tokenizer import Tokenizer
from megabam.data.training_data import TrainingData, prepared_mixture, single_dataset
from megabam.eval.passkey import passkey_accuracy
from megabam.train import checkpoint
from megabam.train.compatibility import config_changes
from megabam.train.engine import TrainingModel, build_engine, build_topology, init_distributed
from megabam.train.logger import RunLogger, head_parameters, peak_tflops
from megabam.train.plot import plot_loss
from megabam.model.transformer import expand_pattern
from megabam.train.preemption import Preempted, PreemptionFlag
from megabam.train.window_sampler import WindowSampler


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (never overwritten silently)."""


class TooManyBadSteps(RuntimeError):
    """train.max_bad_steps consecutive steps had a non-finite loss or gradient norm."""


@dataclass
class Summary:
    run_dir: str
    steps: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    final_loss: float
    val_loss: float
    params: int
    skipped_steps: int
    checkpoint: str
    loss_plot: str
    passkey: dict[int, float]  # prompt length → share of keys retrieved

    def lines(self) -> list[str]:
        return [
            f"run directory   {self.run_dir}",
            f"parameters      {self.params:,}",
            f"steps           {self.steps}   tokens {self.tokens:,}   skipped (non-finite) {self.skipped_steps}",
            f"wall time       {self.wall_s:.1f} s   ({self.tokens_per_s:,.0f} tokens/s)",
            f"train loss      {self.final_loss:.4f} (mean of the last logged steps)",
            f"val loss        {self.val_loss:.4f}   (perplexity {math.exp(min(self.val_loss, 50)):.2f})",
            *(f"passkey @ {n:<6}  {acc:.0%} retrieved" for n, acc in self.passkey.items()),
            f"checkpoint      {self.checkpoint}",
            f"loss plot       {self.loss_plot}",
        ]


def choose_run_directory(cfg: Config, fresh: bool, resume: bool) -> tuple[Path, bool]:
    """(directory, whether to resume). A directory with checkpoints is resumed automatically; one
    with files but no checkpoint is refused; `fresh` starts a new run beside it (name-2, name-3, ...);
    `resume` insists on a checkpoint. Nothing is ever overwritten."""
    base = Path(cfg.run.output_dir) / cfg.run.name

    def empty(path: Path) -> bool:
        return not path.exists() or not any(path.iterdir())

    if fresh:
        candidate, n = base, 1
        while not empty(candidate):
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")
        return candidate, False
    if checkpoint.list_tags(base):
        return base, True
    if resume:
        raise RunDirError(f"{base}: no checkpoint to resume from")
    if not empty(base):
        raise RunDirError(f"{base}: holds files but no checkpoint; pass --fresh to start a new run beside it, or set run.name")
    return base, False


def train(cfg: Config, fresh: bool = False, resume: bool = False) -> Summary:
    os.environ.setdefault("WANDB_MODE", cfg.logging.wandb_mode)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # Attention probabilities under a sharp prior underflow into denormals, which x86 CPUs multiply
    # ~100x slower than normal floats; flushing them to zero changes no result that matters.
    torch.set_flush_denormal(True)
    run_dir, resuming = choose_run_directory(cfg, fresh, resume)
    init_distributed()
    rank = dist.get_rank()
    topology = build_topology(cfg)
    dist.barrier()  # every rank has chosen the directory before rank 0 writes into it
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    say = print if rank == 0 else (lambda *_: None)

    data = _build_data(cfg, rank)
    tokenizer = Tokenizer(data.tokenizer_path)
    passkey_lengths = cfg.eval.passkey_lengths or [cfg.data.seq_len]
    _check_passkey_lengths(tokenizer, passkey_lengths if cfg.eval.passkey_samples else [])
    trained = build_engine(cfg, topology)
    engine = trained.engine
    checkpoint.use_weights_only_loading(engine)
    # Tensor- and pipeline-parallel peers (consecutive ranks) read identical samples.
    replication = topology.layout.replication
    train_loader = build_loader(data.train, micro_batch_size=cfg.train.micro_batch_size, shuffle=True,
                                seed=cfg.run.seed, num_workers=cfg.data.num_workers, vocab_size=cfg.model.vocab_size,
                                replication=replication)
    val_loader = build_loader(data.val, micro_batch_size=cfg.train.micro_batch_size, shuffle=False,
                              seed=cfg.run.seed, num_workers=0, vocab_size=cfg.model.vocab_size,
                              replication=replication)

    # SWA layers get a window drawn per step (a pure function of seed and step: same on every rank).
    sampler = WindowSampler(cfg.window, cfg.run.seed, cfg.train.steps) if "swa" in expand_pattern(cfg.model.layer_pattern) else None
    if sampler is not None:
        say(sampler.describe())
    meta = _resume(engine, train_loader, sampler, cfg, run_dir, say) if resuming else None
    start_step = meta["step"] if meta else 0
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        shutil.copyfile(data.tokenizer_path, run_dir / "tokenizer.model")
        _truncate_metrics(run_dir / "metrics.jsonl", start_step)
    dist.barrier()

    log = RunLogger(cfg, run_dir, start_step, meta.get("wandb_id") if meta else None, enabled=rank == 0)
    try:
        with PreemptionFlag() as preemption:
            return _loop(cfg, trained, topology, train_loader, val_loader, sampler, tokenizer, run_dir, meta, log,
                         preemption, device, passkey_lengths)
    finally:
        log.close()


def _resume(engine, train_loader, sampler, cfg: Config, run_dir: Path, say) -> dict:
    """Load the newest valid checkpoint after checking that the config change is allowed."""
    tag = checkpoint.find_valid(run_dir, say)
    if tag is None:
        raise RunDirError(f"{checkpoint.checkpoint_root(run_dir)}: no usable checkpoint to resume from")
    saved = json.loads((checkpoint.checkpoint_root(run_dir) / tag / checkpoint.META_FILE).read_text())
    refused, accepted = config_changes(saved["config"], asdict(cfg))
    if refused:
        raise ConfigError("<resume>", "config", f"cannot resume {run_dir / 'checkpoints' / tag} with changed " + "; ".join(refused))
    for line in accepted:
        say(f"resume: accepted config change {line}")
    t0 = time.perf_counter()
    meta = checkpoint.load(engine, run_dir, tag)
    train_loader.load_state_dict(meta["loader"])
    if sampler is not None and meta.get("window_sampler"):
        try:
            sampler.load_state_dict(meta["window_sampler"])
        except ValueError as e:  # its config keys were accepted above; the windows drawn from here on change
            say(f"resume: {e}")
    say(f"resumed from {checkpoint.checkpoint_root(run_dir) / tag} at step {meta['step']} "
        f"(loaded in {time.perf_counter() - t0:.2f} s)")
    return meta


def _loop(cfg, trained, topology, train_loader, val_loader, sampler, tokenizer, run_dir, meta, log, preemption, device,
          passkey_lengths):
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = trained.engine
    start_step = meta["step"] if meta else 0
    skipped_total = meta.get("skipped_steps", 0) if meta else 0
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len * topology.dp_size
    peak = peak_tflops(cfg.logging)
    batches = _endless(train_loader)
    recent_losses: list[float] = []
    interval_losses: list[float] = []
    bad_in_a_row = 0
    last_saved = start_step if meta else None
    val_loss = math.nan

    def save(step: int) -> None:
        nonlocal last_saved
        t0 = time.perf_counter()
        path = checkpoint.save(engine, run_dir, step, {
            "tokens": step * tokens_per_step, "samples": step * tokens_per_step // cfg.data.seq_len,
            "loader": train_loader.state_dict(), "config": asdict(cfg), "skipped_steps": skipped_total,
            "tokenizer": str(run_dir / "tokenizer.model"), "wandb_id": log.wandb_id,
            "window_sampler": sampler.state_dict() if sampler is not None else None,
        }, keep=cfg.checkpoint.keep)
        last_saved = step
        log.log(step, {"checkpoint_save_s": time.perf_counter() - t0})
        log.write(f"saved {path} in {time.perf_counter() - t0:.2f} s")

    t_start = time.perf_counter()
    for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        lr = _current_lr(engine)
        window = sampler.window(step) if sampler is not None else None
        micro_batches = [{k: v.to(device) for k, v in next(batches).items()} for _ in range(cfg.train.grad_accum)]
        loss_sum = _train_step(trained, micro_batches, window, poison=step + 1 in cfg.train.debug_nan_steps)
        # One collective per step: the loss, whether DeepSpeed applied the update (it skips one
        # whose gradient norm is not finite, on every rank alike), and whether any rank was signalled.
        flags = torch.tensor([not engine.was_step_applied(), preemption.requested], dtype=torch.float64, device=device)
        stats = torch.cat([loss_sum.reshape(1), flags])  # built on the device: no sync before the collective
        dist.all_reduce(stats)
        # Tensor-parallel peers hold the same loss, so the mean over all ranks is the data-parallel mean.
        loss_value = stats[0].item() / (cfg.train.grad_accum * world)
        done = step + 1
        step_s = time.perf_counter() - t0
        tokens_per_s = tokens_per_step / step_s
        log.step(done, loss_value, tokens_per_s, lr)
        if window is not None:
            log.log(done, {"window": window})

        if stats[1] > 0 or not math.isfinite(loss_value):
            skipped_total += 1
            bad_in_a_row += 1
            log.write(f"step {done}: non-finite loss or gradient norm, update skipped ({bad_in_a_row} in a row)")
            log.log(done, {"skipped_steps": skipped_total})
            if cfg.train.max_bad_steps and bad_in_a_row >= cfg.train.max_bad_steps:
                good = checkpoint.checkpoint_root(run_dir) / checkpoint.tag_for(last_saved) if last_saved else "none"
                raise TooManyBadSteps(f"{bad_in_a_row} consecutive steps with a non-finite loss or gradient norm "
                                      f"(last at step {done}); last good checkpoint: {good}")
        else:
            bad_in_a_row = 0
            recent_losses = (recent_losses + [loss_value])[-10:]
            interval_losses.append(loss_value)

        if interval_losses and (done % cfg.logging.log_every == 0 or done == cfg.train.steps):
            # the mean over the interval: one step's loss swings with its batch's mix of documents
            metrics = {"loss": sum(interval_losses) / len(interval_losses), "lr": lr,
                       "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                       "tokens_per_s": tokens_per_s, "tokens": done * tokens_per_step,
                       "tflops_per_device": tokens_per_s * trained.flops_per_token / world / 1e12}
            if peak:
                metrics["mfu"] = metrics["tflops_per_device"] / peak
            metrics.update(_head_parameters(trained, topology))
            log.log(done, metrics)
            interval_losses = []
        if (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done == cfg.train.steps:
            val_loss = evaluate(trained, val_loader, cfg.train.eval_batches, device)
            log.log(done, {"val_loss": val_loss})
        # No periodic save inside a streak of bad steps: pruning must not push out the last good one.
        periodic = (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.train.steps
        if periodic and bad_in_a_row == 0:
            save(done)
        if stats[2] > 0:
            if last_saved != done:
                save(done)
            log.write(f"preempted ({preemption.signal_name or 'signal on another rank'}) after step {done}; checkpoint saved")
            raise Preempted(done)
    wall = time.perf_counter() - t_start
    if last_saved != cfg.train.steps:
        save(cfg.train.steps)  # a resumed run that had already reached its end

    passkey = {}
    # Every tensor-parallel rank and pipeline stage of the first data-parallel replica takes part.
    if cfg.eval.passkey_samples and topology.dp_rank == 0:
        engine.eval()
        for n in passkey_lengths:
            passkey[n] = passkey_accuracy(trained.predict, tokenizer, n, cfg.eval.passkey_samples, cfg.run.seed, device)
        engine.train()
        log.log(cfg.train.steps, {f"passkey_{n}": acc for n, acc in passkey.items()})
    dist.barrier()
    if rank == 0:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    steps_run = cfg.train.steps - start_step
    return Summary(
        run_dir=str(run_dir), steps=cfg.train.steps, tokens=cfg.train.steps * tokens_per_step, wall_s=wall,
        tokens_per_s=steps_run * tokens_per_step / wall if steps_run else 0.0,
        final_loss=sum(recent_losses) / len(recent_losses) if recent_losses else math.nan, val_loss=val_loss,
        params=trained.params, skipped_steps=skipped_total,
        checkpoint=str(checkpoint.checkpoint_root(run_dir) / checkpoint.tag_for(cfg.train.steps)),
        loss_plot=str(run_dir / "loss.png"), passkey=passkey,
    )


def _current_lr(engine) -> float:
    """The peak-relative learning rate this step will use (group lr divided by its multiplier)."""
    group = engine.optimizer.param_groups[0]
    return group["lr"] / group["lr_mult"]


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop the metrics of steps after the checkpoint (they are recomputed) and any line
    cut short by a kill."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("step", 0) <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def _build_data(cfg: Config, rank: int) -> TrainingData:
    """Streams and tokenizer of the run. data.source=default: rank 0 builds (or finds cached) the
    default dataset, the others then read the cache. data.source=mds: the prepared datasets of
    data.streams, refused (ConfigError) if the tokenizer or the datasets disagree with the config."""
    if cfg.data.source == "mds":
        try:
            return prepared_mixture(cfg.data.streams, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.seq_len,
                                    verify_hashes=cfg.data.verify_hashes)
        except DataError as e:
            raise ConfigError("<config>", "data", str(e)) from None
    cache_root = Path(cfg.data.cache_dir or os.environ.get("MEGABAM_CACHE") or "~/.cache/megabam").expanduser()

    def build():
        return build_default_dataset(
            cache_root, sample_len=cfg.data.seq_len + 1, vocab_size=cfg.model.vocab_size,
            corpus_bytes=cfg.data.corpus_bytes, passkey_fraction=cfg.data.passkey_fraction,
            val_fraction=cfg.data.val_fraction, seed=cfg.run.seed,
        )

    data = build() if rank == 0 else None
    dist.barrier()
    data = data if data is not None else build()
    return single_dataset(data.train_dir, data.val_dir, data.tokenizer_path)


def _check_passkey_lengths(tokenizer: Tokenizer, lengths: list[int]) -> None:
    """Refuse, before training, passkey lengths too short for the prompt under this tokenizer."""
    for i, n in enumerate(lengths):
        try:
            passkey_sample(tokenizer, n - 8, 0.0, "12345")  # 8: room for the key's tokens
        except ValueError:
            raise ConfigError("<config>", f"eval.passkey_lengths[{i}]", f"{n} tokens cannot hold a passkey prompt") from None


def _endless(loader) -> Iterator[dict]:
    """Batches across epoch boundaries; each pass over the streaming loader is one epoch."""
    while True:
        yield from loader


def _head_parameters(trained: TrainingModel, topology) -> dict[str, float]:
    """Per-head prior and SSMax values of every layer this rank's pipeline holds (collective over the
    pipeline group; each stage knows its own layers). Under TP, this tensor rank's heads."""
    mine = head_parameters(trained.local_blocks())
    if topology.pp_size == 1:
        return mine
    stages: list = [None] * topology.pp_size
    dist.all_gather_object(stages, mine, group=topology.pp_group)
    return {key: value for stage in stages for key, value in stage.items()}


def _train_step(trained: TrainingModel, micro_batches: list[dict], window, poison: bool) -> torch.Tensor:
    """One optimizer step over the micro-batches; returns their losses summed (float64). Under
    pipeline parallelism the engine returns the mean over the micro-batches and data-parallel ranks
    on every rank, so the sum is that mean times the number of micro-batches."""
    engine = trained.engine
    if trained.pipeline is not None:
        trained.pipeline.window, trained.pipeline.poison_loss = window, poison
        loss = engine.train_batch(iter([_pipeline_batch(b) for b in micro_batches]))
        return loss.detach().double() * len(micro_batches)
    loss_sum = torch.zeros((), device=micro_batches[0]["input_ids"].device, dtype=torch.float64)
    for batch in micro_batches:
        loss = engine(batch["input_ids"], batch["labels"], batch["doc_ids"], window)
        if poison:
            loss = loss * math.nan
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().double()
    return loss_sum


def _pipeline_batch(batch: dict) -> tuple:
    """A micro-batch as DeepSpeed's pipeline engine takes it: (first stage's inputs, last stage's labels)."""
    return (batch["input_ids"], batch["doc_ids"]), batch["labels"]


@torch.no_grad()
def evaluate(trained: TrainingModel, loader, max_batches: int, device: torch.device) -> float:
    """Mean validation loss over the first `max_batches` batches, averaged over data-parallel ranks."""
    engine = trained.engine
    batches = [{k: v.to(device) for k, v in b.items()} for b in itertools.islice(loader, max_batches)]
    if trained.pipeline is not None:
        # Every stage must run the same number of micro-batches: the fewest any rank has.
        count = torch.tensor([len(batches)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        batches = batches[:int(count)]
        if not batches:
            return math.nan
        trained.pipeline.window, trained.pipeline.poison_loss = None, False
        loss = engine.eval_batch(iter([_pipeline_batch(b) for b in batches]), num_micro_batches=len(batches))
        return float(loss)
    engine.eval()
    total = torch.zeros(2, device=device)
    for batch in batches:
        total[0] += engine(batch["input_ids"], batch["labels"], batch["doc_ids"]).float()
        total[1] += 1
    engine.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item() if total[1] > 0 else math.nan
