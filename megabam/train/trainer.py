"""The training loop: data → DeepSpeed engine → metrics, evaluation and checkpoints, with auto-resume,
preemption handling and a guard against non-finite steps.

`Trainer` owns the run: the topology, the engine, the loaders, the window sampler, the logger and the
counters in `Progress`. `run` repeats `train_step` → `record` → maybe `evaluate` → maybe
`save_checkpoint` until the last step, then `finish` (final checkpoint, passkey score, plot, summary).
"""

import itertools
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megabam import exit_codes, staging
from megabam.checkpoint import store
from megabam.checkpoint.shards import shard_identity
from megabam.checkpoint.store import CheckpointMeta
from megabam.checkpoint.weights_only import use_weights_only_loading
from megabam.config import Config, ConfigError, save_config
from megabam.config.schema import expand_pattern
from megabam.data.errors import DataError
from megabam.data.loader import build_loader, load_loader_state
from megabam.data.passkey import passkey_sample
from megabam.data.shm_cleanup import clean_streaming
from megabam.data.tokenizer import (
    HF_CONFIG,
    TOKENIZER_FILES,
    Tokenizer,
    copy_tokenizer,
    open_tokenizer,
    same_tokenizer,
    tokenizer_in,
)
from megabam.data.training_data import build_training_data
from megabam.eval.figures import heatmap
from megabam.eval.passkey import passkey_accuracy, passkey_grid
from megabam.log import setup_logging
from megabam.parallel.distributed import init_distributed
from megabam.parallel.topology import build_topology
from megabam.plan.counts import meta_model
from megabam.plan.memory import memory_bytes
from megabam.plan.planner import config_layout
from megabam.train.compatibility import config_changes
from megabam.train.engine import build_engine, tracked_step
from megabam.train.logger import RunLogger, peak_tflops
from megabam.train.plot import plot_loss
from megabam.train.preemption import Preempted, PreemptionFlag
from megabam.train.run_lock import RunDirError, RunLock
from megabam.train.window_sampler import WindowSampler

log = logging.getLogger(__name__)


class TooManyBadSteps(RuntimeError):
    """train.max_bad_steps consecutive steps had a non-finite loss or gradient norm."""


SUMMARY_FILE = "summary.json"  # the finished run's Summary, written after its last checkpoint


@dataclass
class Summary:
    run_dir: str
    steps: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    final_loss: float
    val_loss: float | None  # None: validation off (train.eval_batches=0)
    params: int
    skipped_steps: int
    checkpoint: str
    loss_plot: str | None  # None with logging.plots off
    passkey: dict[int, float]  # prompt length → share of keys retrieved
    passkey_plot: str | None  # the heatmap of retrieval by length and needle depth

    def lines(self) -> list[str]:
        return [
            f"run directory   {self.run_dir}",
            f"parameters      {self.params:,}",
            f"steps           {self.steps}   tokens {self.tokens:,}   skipped (non-finite) {self.skipped_steps}",
            f"wall time       {self.wall_s:.1f} s   ({self.tokens_per_s:,.0f} tokens/s)",
            f"train loss      {self.final_loss:.4f} (mean of the last logged steps)",
            f"val loss        {self.val_loss:.4f}   (perplexity {math.exp(min(self.val_loss, 50)):.2f})"
            if self.val_loss is not None
            else "val loss        off (train.eval_batches=0)",
            *(f"passkey @ {n:<6}  {acc:.0%} retrieved" for n, acc in self.passkey.items()),
            f"checkpoint      {self.checkpoint}",
            *([f"loss plot       {self.loss_plot}"] if self.loss_plot else []),
            *([f"passkey plot    {self.passkey_plot}"] if self.passkey_plot else []),
        ]

    @classmethod
    def read(cls, path: Path) -> "Summary":
        raw = json.loads(path.read_text())
        raw["passkey"] = {int(n): acc for n, acc in raw["passkey"].items()}  # JSON keys are strings
        return cls(**raw)


class AlreadyComplete(Exception):
    """The run directory holds a run that reached train.steps; `summary` is what it reported."""

    def __init__(self, summary: Summary):
        super().__init__(summary.steps)
        self.summary = summary


def completed_summary(run_dir: Path, cfg: Config) -> Summary | None:
    """The stored summary of a run in `run_dir` that finished at train.steps (its newest checkpoint at
    that step and its summary written after it), else None. A config change the run cannot take is
    refused (ConfigError) as a resume would refuse it."""
    path, steps = run_dir / SUMMARY_FILE, cfg.train.steps
    tags = store.list_tags(run_dir)
    if not path.is_file() or not tags or tags[0] != store.tag_for(steps):
        return None
    try:
        summary = Summary.read(path)
    except (ValueError, TypeError, KeyError, AttributeError):  # unreadable: finish the run again
        return None
    try:
        saved = store.read_meta(run_dir, tags[0])
    except (OSError, ValueError):  # a damaged checkpoint: the resume path reports it and falls back
        return None
    if summary.steps != steps:
        return None
    _allowed_changes(saved.config, cfg, store.checkpoint_root(run_dir) / tags[0])
    return summary


def _allowed_changes(saved: dict, cfg: Config, where: Path) -> list[str]:
    """The config changes from a checkpoint's config that a resume takes; ConfigError naming the others."""
    refused, accepted = config_changes(saved, asdict(cfg))
    if refused:
        raise ConfigError("<resume>", "config", f"cannot resume {where} with changed " + "; ".join(refused))
    return accepted


@dataclass
class Progress:
    """What the loop carries from step to step. `step` and `skipped_steps` survive a resume (they are
    in the checkpoint); the rest starts afresh."""

    step: int = 0  # optimizer steps done
    skipped_steps: int = 0  # updates skipped because the loss or gradient norm was not finite
    bad_in_a_row: int = 0
    last_saved: int | None = None  # step of the newest checkpoint of this run
    recent_losses: list[float] = field(default_factory=list)  # the last 10 finite losses (summary)
    interval_losses: list[float] = field(default_factory=list)  # finite losses since the last metrics row
    val_loss: float | None = None  # None until a validation ran (never with train.eval_batches=0)


@dataclass
class StepResult:
    """One optimizer step as every rank agrees on it (after the step's all-reduce)."""

    loss: float  # mean over micro-batches and data-parallel ranks
    skipped: bool  # DeepSpeed dropped the update (non-finite gradient norm) or the loss is not finite
    preempt: bool  # some rank was signalled
    interrupt: bool  # the signal was SIGINT (Ctrl-C) on some rank: stop for good, not for a requeue
    lr: float
    window: int | None
    tokens_per_s: float


FINAL_DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]  # needle depths of the end-of-training passkey grid
# What megabam writes into a run directory before its first checkpoint: a directory holding only
# these (and no checkpoint) is a start that failed early, and is restarted from step 0.
START_FILES = {
    "config.yaml",
    "metrics.jsonl",
    "loss.png",
    "wandb",
    "tensorboard",
    "checkpoints",
    *TOKENIZER_FILES,
    HF_CONFIG,
}


def _fresh_optimizer_note(warmup_steps: int) -> str:
    """What a run started from other weights (train.init_from) does with its learning rate: Adam's
    moments start at zero, and its first steps at the full rate can undo what the weights learned (a
    trained model's passkey retrieval was gone after 10 such steps)."""
    note = "the optimizer, schedule and data start fresh"
    if warmup_steps:
        return f"{note}; the learning rate warms up over schedule.warmup_steps={warmup_steps} steps"
    return (
        f"{note}; WARNING: schedule.warmup_steps=0 starts the fresh optimizer at the full learning rate, which "
        "can undo what these weights learned within a few steps: warm up (e.g. 5-10 % of train.steps)"
    )


def _only_start_files(path: Path) -> bool:
    return all(p.name in START_FILES for p in path.iterdir())


def choose_run_directory(cfg: Config, fresh: bool, resume: bool, lock: bool) -> tuple[Path, bool, RunLock | None]:
    """(directory, whether to resume, its lock when `lock`). A directory with checkpoints is resumed
    automatically; one holding only what an earlier start wrote before its first checkpoint restarts
    from step 0; one with other files is refused; `fresh` starts a new run beside it (name-2, ...);
    `resume` insists on a checkpoint. A directory another run holds is refused (or, with `fresh`,
    skipped). Rank 0 locks (`lock`); the other ranks follow its choice. Nothing is ever overwritten."""
    base = Path(cfg.run.output_dir) / cfg.run.name

    def empty(path: Path) -> bool:
        return not path.exists() or not any(path.iterdir())

    if fresh:
        candidate, n = base, 1
        while True:
            held = RunLock(candidate) if lock else None
            if empty(candidate) and (held is None or held.try_acquire() is None):
                return candidate, False, held
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")
    held = RunLock(base).acquire() if lock else None
    try:
        if store.list_tags(base):
            return base, True, held
        if resume:
            raise RunDirError(base, None, "no checkpoint to resume from")
        if not empty(base):
            if not _only_start_files(base):
                raise RunDirError(
                    base,
                    None,
                    "holds files but no checkpoint; pass --fresh to start a new run beside it, or set run.name",
                )
            log.info(f"{base}: no checkpoint yet, only what an earlier start wrote; starting again from step 0")
        return base, False, held
    except BaseException:
        if held is not None:
            held.release()
        raise


def _check_init_tokenizer(folder: Path, tokenizer: Path) -> None:
    """A run started from a folder's weights must read data tokenized as that model was trained."""
    theirs = tokenizer_in(folder)
    if theirs is not None and not same_tokenizer(theirs, Path(tokenizer)):
        raise ConfigError(
            "<train.init_from>",
            "train.init_from",
            f"{theirs} differs from the run's tokenizer {tokenizer}: prepare the data with the folder's tokenizer "
            "(megabam data prepare --tokenizer) and set data.tokenizer to it",
        )


class Trainer:
    """One run of `megabam train` on this rank (every rank builds one; they step together)."""

    def __init__(self, cfg: Config, run_dir: Path, resuming: bool):
        self.cfg, self.run_dir = cfg, run_dir
        init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.topology = build_topology(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data)
        dist.barrier()  # every rank has chosen the directory before rank 0 writes into it

        data = build_training_data(cfg, self.rank)
        self.tokenizer = open_tokenizer(data.tokenizer_path)
        self.passkey_lengths = cfg.eval.passkey_lengths or [cfg.data.seq_len]
        _check_passkey_lengths(self.tokenizer, self.passkey_lengths if cfg.eval.passkey_samples else [])
        if cfg.train.init_from and not resuming:
            _check_init_tokenizer(Path(cfg.train.init_from), self.tokenizer.path)
        self.engine = build_engine(cfg, self.topology)
        if cfg.train.init_from and not resuming:
            log.info(f"weights from {cfg.train.init_from}; {_fresh_optimizer_note(cfg.schedule.warmup_steps)}")
        use_weights_only_loading(self.engine.deepspeed)
        # Tensor- and pipeline-parallel peers (consecutive ranks) read identical samples.
        loader = dict(
            micro_batch_size=cfg.train.micro_batch_size,
            seed=cfg.run.seed,
            vocab_size=cfg.model.vocab_size,
            replication=self.topology.layout.replication,
        )
        # What streaming jobs killed outright left in /dev/shm (it never frees them): only this user's
        # segments that no live process maps, and none younger than a few seconds.
        removed = clean_streaming(mine_too=False)
        if removed:
            log.info(f"removed {removed} shared-memory segments that dead streaming jobs left in /dev/shm")
        self.train_loader = build_loader(data.train, shuffle=True, num_workers=cfg.data.num_workers, **loader)
        if len(self.train_loader) == 0:  # streaming would yield nothing, and the loop wait for ever
            raise ConfigError(
                "<data>",
                "train.micro_batch_size",
                f"{cfg.train.micro_batch_size} is more than the "
                f"{len(self.train_loader.dataset)} training samples each data-parallel rank reads per epoch",
            )
        self.val_loader = None
        if cfg.train.eval_batches:
            self.val_loader = build_loader(data.val, shuffle=False, num_workers=0, **loader)
            if len(self.val_loader) == 0:  # streaming would yield no batch: a val loss of NaN at every evaluation
                raise ConfigError(
                    "<data>",
                    "train.eval_batches",
                    f"the validation data holds {len(self.val_loader.dataset)} samples per data-parallel rank, "
                    f"fewer than one micro-batch of {cfg.train.micro_batch_size} (train.micro_batch_size): prepare "
                    "more validation data (data prepare --val-fraction) or set train.eval_batches=0 to train "
                    "without validation",
                )
        self.batches = _endless(self.train_loader)
        # SWA layers get a window drawn per step (a pure function of seed and step: same on every rank).
        has_swa = "swa" in expand_pattern(cfg.model.layer_pattern)
        self.sampler = WindowSampler(cfg.window, cfg.run.seed, cfg.train.steps) if has_swa else None
        if self.sampler is not None:
            log.info(self.sampler.describe())

        self.progress = Progress()
        wandb_id = None
        if resuming:
            meta = self._resume()
            self.progress = Progress(step=meta.step, skipped_steps=meta.skipped_steps, last_saved=meta.step)
            wandb_id = meta.wandb_id
        if self.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, run_dir / "config.yaml")
            copy_tokenizer(self.tokenizer, run_dir)
            _truncate_metrics(run_dir / "metrics.jsonl", self.progress.step)
        dist.barrier()
        self.logger = RunLogger(cfg, run_dir, self.progress.step, wandb_id, enabled=self.rank == 0)
        self.tokens_per_step = (
            cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len * self.topology.dp_size
        )
        self.peak_tflops = peak_tflops(cfg.logging)
        # The planner's memory per GPU for this layout, logged beside the measured peak.
        layout = config_layout(cfg, self.world)
        self.predicted_memory = memory_bytes(cfg, meta_model(cfg), layout, self.engine.device.type)
        self.measured_peak: float | None = None

    def _resume(self) -> CheckpointMeta:
        """Load the newest checkpoint that verifies and loads, after checking that the config change
        is allowed; one that fails to load is reported and the previous one tried."""
        root = store.checkpoint_root(self.run_dir)
        for tag in store.valid_tags(self.run_dir, log.info):
            try:
                saved = store.read_meta(self.run_dir, tag)
            except store.NewerMeta:
                raise
            except store.CheckpointError as e:  # garbled metadata its manifest vouches for: damage
                done = store.set_aside(self.run_dir, tag)
                log.info(f"checkpoint {root / tag} is unusable ({e}); {done}")
                continue
            if saved.step > self.cfg.train.steps:
                raise RunDirError(
                    root / tag,
                    None,
                    f"the checkpoint is at step {saved.step}, beyond train.steps={self.cfg.train.steps}; "
                    "nothing to do (raise train.steps to train on)",
                )
            for line in _allowed_changes(saved.config, self.cfg, root / tag):
                log.info(f"resume: accepted config change {line}")
            t0 = time.perf_counter()
            try:
                meta = store.load(self.engine.deepspeed, self.run_dir, tag, shard=self._shard())
            except store.UnusableCheckpoint as e:
                done = store.set_aside(self.run_dir, tag)
                log.info(f"checkpoint {root / tag} is unusable (it does not load: {e}); {done}")
                continue
            load_loader_state(self.train_loader, meta.loader)
            if self.sampler is not None and meta.window_sampler:
                try:
                    self.sampler.load_state_dict(meta.window_sampler)
                except ValueError as e:  # its config keys were accepted above; the windows drawn from here on change
                    log.info(f"resume: {e}")
            log.info(f"resumed from {root / tag} at step {meta.step} (loaded in {time.perf_counter() - t0:.2f} s)")
            return meta
        raise RunDirError(root, None, "no usable checkpoint to resume from")

    def _shard(self) -> dict:
        """This rank's identity, recorded in the weights files it saves and checked on resume."""
        topo = self.topology
        return shard_identity(topo.tp_rank, topo.tp_size, topo.pp_size)

    def train_step(self, preemption: PreemptionFlag) -> StepResult:
        """One optimizer step; one collective agrees on its loss, whether the update was applied and
        whether any rank was signalled."""
        cfg, engine, step = self.cfg, self.engine, self.progress.step
        t0 = time.perf_counter()
        lr = engine.current_lr()
        window = self.sampler.window(step) if self.sampler is not None else None
        micro_batches = [
            {k: v.to(engine.device) for k, v in next(self.batches).items()} for _ in range(cfg.train.grad_accum)
        ]
        if cfg.logging.track_memory and engine.device.type == "cpu" and step == 1:  # Adam's state exists now
            loss_sum, self.measured_peak = tracked_step(engine, micro_batches, window)
        else:
            loss_sum = engine.step(micro_batches, window)
        # DeepSpeed skips an update whose gradient norm is not finite, on every rank alike.
        flags = torch.tensor(
            [not engine.deepspeed.was_step_applied(), preemption.requested, preemption.interrupted],
            dtype=torch.float64,
            device=engine.device,
        )
        stats = torch.cat([loss_sum.reshape(1), flags])  # built on the device: no sync before the collective
        dist.all_reduce(stats)
        # Tensor-parallel peers hold the same loss, so the mean over all ranks is the data-parallel mean.
        loss = stats[0].item() / (cfg.train.grad_accum * self.world)
        self.progress.step = step + 1
        return StepResult(
            loss=loss,
            skipped=bool(stats[1] > 0) or not math.isfinite(loss),
            preempt=bool(stats[2] > 0),
            interrupt=bool(stats[3] > 0),
            lr=lr,
            window=window,
            tokens_per_s=self.tokens_per_step / (time.perf_counter() - t0),
        )

    def record(self, result: StepResult) -> None:
        """Progress bar, window and bad-step bookkeeping, and every log_every steps a metrics row."""
        cfg, p, done = self.cfg, self.progress, self.progress.step
        self.logger.step(done, result.loss, result.tokens_per_s, result.lr)
        if result.window is not None:
            self.logger.log(done, {"window": result.window})
        if result.skipped:
            p.skipped_steps += 1
            p.bad_in_a_row += 1
            log.info(f"step {done}: non-finite loss or gradient norm, update skipped ({p.bad_in_a_row} in a row)")
            self.logger.log(done, {"skipped_steps": p.skipped_steps})
            if cfg.train.max_bad_steps and p.bad_in_a_row >= cfg.train.max_bad_steps:
                root = store.checkpoint_root(self.run_dir)
                good = root / store.tag_for(p.last_saved) if p.last_saved else "none"
                raise TooManyBadSteps(
                    f"{p.bad_in_a_row} consecutive steps with a non-finite loss or gradient norm "
                    f"(last at step {done}); last good checkpoint: {good}"
                )
        else:
            p.bad_in_a_row = 0
            p.recent_losses = (p.recent_losses + [result.loss])[-10:]
            p.interval_losses.append(result.loss)
        if p.interval_losses and (done % cfg.logging.log_every == 0 or done == cfg.train.steps):
            # the mean over the interval: one step's loss swings with its batch's mix of documents
            engine = self.engine
            metrics = {
                "loss": sum(p.interval_losses) / len(p.interval_losses),
                "lr": result.lr,
                "grad_norm": float(engine.deepspeed.get_global_grad_norm() or 0.0),
                "tokens_per_s": result.tokens_per_s,
                "tokens": done * self.tokens_per_step,
                "tflops_per_device": result.tokens_per_s * engine.flops_per_token / self.world / 1e12,
            }
            if self.peak_tflops:
                metrics["mfu"] = metrics["tflops_per_device"] / self.peak_tflops
            metrics.update(self.memory_metrics())
            metrics.update(engine.head_parameters())
            self.logger.log(done, metrics)
            p.interval_losses = []

    def memory_metrics(self) -> dict[str, float]:
        """The measured peak of allocated tensors since the last row (CUDA: the allocator's; CPU: step 2's
        under logging.track_memory) beside the planner's prediction, in MiB."""
        device = self.engine.device
        if device.type == "cuda":
            self.measured_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if self.measured_peak is None:
            return {}
        row = {
            "peak_memory_mib": self.measured_peak / 2**20,
            "predicted_memory_mib": self.predicted_memory["total"] / 2**20,
        }
        if device.type != "cuda":
            self.measured_peak = None  # one measurement on CPU
        return row

    def evaluate(self) -> float | None:
        """Mean validation loss over the first train.eval_batches batches, averaged over data-parallel ranks
        (None with validation off), and the passkey score at the training length while training goes on."""
        device = self.engine.device
        metrics = {}
        if self.val_loader is not None:
            batches = [
                {k: v.to(device) for k, v in b.items()}
                for b in itertools.islice(self.val_loader, self.cfg.train.eval_batches)
            ]
            metrics["val_loss"] = self.progress.val_loss = self.engine.mean_loss(batches)
        # Retrieval at the training length as training goes (diagnostic curves; cheap: a few prompts).
        seq_len = self.cfg.data.seq_len
        during = self.progress.step < self.cfg.train.steps and holds_passkey(self.tokenizer, seq_len)
        metrics.update(self.passkey([seq_len]) if during else {})
        if metrics:
            self.logger.log(self.progress.step, metrics)
        return self.progress.val_loss

    def passkey(self, lengths: list[int]) -> dict[str, float]:
        """Passkey scores per length (retrieved share and key-token share) of eval.passkey_samples
        prompts, needle depths spread evenly, as metrics. Every tensor-parallel rank and pipeline
        stage of the first data-parallel replica takes part; the other replicas return nothing and
        meet them at the next collective."""
        cfg, scores = self.cfg, {}
        if not cfg.eval.passkey_samples or self.topology.dp_rank != 0:
            return scores
        engine = self.engine.deepspeed
        engine.eval()
        for n in lengths:
            score = passkey_accuracy(
                self.engine.predict, self.tokenizer, n, cfg.eval.passkey_samples, cfg.run.seed, self.engine.device
            )
            scores[f"passkey_{n}"], scores[f"passkey_{n}_key_tokens"] = score
        engine.train()
        return scores

    def passkey_heatmap(self) -> tuple[dict[str, float], Path | None]:
        """The end-of-training passkey grid: eval.passkey_lengths × FINAL_DEPTHS, the prompts shared
        out over the depths; its scores as metrics and, from rank 0, its heatmap (RUN/passkey.png)."""
        cfg = self.cfg
        if not cfg.eval.passkey_samples or self.topology.dp_rank != 0:
            return {}, None
        trials = -(-cfg.eval.passkey_samples // len(FINAL_DEPTHS))
        engine = self.engine.deepspeed
        engine.eval()
        grid = passkey_grid(
            self.engine.predict,
            self.tokenizer,
            self.passkey_lengths,
            FINAL_DEPTHS,
            trials,
            cfg.run.seed,
            self.engine.device,
        )
        engine.train()
        scores = {}
        for n, row in zip(grid.lengths, grid.key_tokens):
            scores[f"passkey_{n}"], scores[f"passkey_{n}_key_tokens"] = grid.by_length()[n], sum(row) / len(row)
        if self.rank != 0 or not cfg.logging.plots:
            return scores, None
        title = f"passkey retrieval, {self.run_dir.name} @ step {cfg.train.steps} (trained at {cfg.data.seq_len})"
        return scores, heatmap(grid.accuracy(), grid.lengths, FINAL_DEPTHS, title, self.run_dir / "passkey.png")

    def save_checkpoint(self) -> Path:
        """Collective: a checkpoint of the current step."""
        cfg, p, step = self.cfg, self.progress, self.progress.step
        t0 = time.perf_counter()
        meta = CheckpointMeta(
            step=step,
            tokens=step * self.tokens_per_step,
            samples=step * self.tokens_per_step // cfg.data.seq_len,
            loader=self.train_loader.state_dict(),
            config=asdict(cfg),
            skipped_steps=p.skipped_steps,
            tokenizer=str(self.run_dir / self.tokenizer.file_name),
            wandb_id=self.logger.wandb_id,
            window_sampler=self.sampler.state_dict() if self.sampler is not None else None,
        )
        path = store.save(self.engine.deepspeed, self.run_dir, meta, keep=cfg.checkpoint.keep, shard=self._shard())
        p.last_saved = step
        self.logger.log(step, {"checkpoint_save_s": time.perf_counter() - t0})
        log.info(f"saved {path} in {time.perf_counter() - t0:.2f} s")
        return path

    def run(self) -> Summary:
        cfg, p = self.cfg, self.progress
        start_step = p.step
        t_start = time.perf_counter()
        with PreemptionFlag() as preemption:
            while p.step < cfg.train.steps:
                result = self.train_step(preemption)
                self.record(result)
                done = p.step
                if (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done == cfg.train.steps:
                    self.evaluate()
                # No periodic save inside a streak of bad steps: pruning must not push out the last good one.
                periodic = (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.train.steps
                if periodic and p.bad_in_a_row == 0:
                    self.save_checkpoint()
                if result.preempt:
                    if p.last_saved != done:
                        self.save_checkpoint()
                    who = preemption.signal_name or "signal on another rank"
                    what = "interrupted" if result.interrupt else "preempted"
                    log.info(f"{what} ({who}) after step {done}; checkpoint saved")
                    raise Preempted(done, exit_codes.INTERRUPTED if result.interrupt else exit_codes.PREEMPTED)
        return self.finish(time.perf_counter() - t_start, start_step)

    def finish(self, wall: float, start_step: int) -> Summary:
        """The last checkpoint, the passkey score, the loss plot and the summary."""
        cfg, p = self.cfg, self.progress
        if p.last_saved != cfg.train.steps:
            self.save_checkpoint()  # a resumed run that had already reached its end
        scores, passkey_plot = self.passkey_heatmap()
        if scores:
            self.logger.log(cfg.train.steps, scores)
        passkey = {n: scores[f"passkey_{n}"] for n in self.passkey_lengths if f"passkey_{n}" in scores}
        dist.barrier()
        loss_plot = self.run_dir / "loss.png" if cfg.logging.plots else None
        if self.rank == 0 and loss_plot:
            plot_loss(self.run_dir / "metrics.jsonl", loss_plot)
            self.logger.image("loss", loss_plot, cfg.train.steps)
        if passkey_plot:
            self.logger.image("passkey", passkey_plot, cfg.train.steps)
        steps_run = cfg.train.steps - start_step
        summary = Summary(
            run_dir=str(self.run_dir),
            steps=cfg.train.steps,
            tokens=cfg.train.steps * self.tokens_per_step,
            wall_s=wall,
            tokens_per_s=steps_run * self.tokens_per_step / wall if steps_run else 0.0,
            final_loss=sum(p.recent_losses) / len(p.recent_losses) if p.recent_losses else math.nan,
            val_loss=p.val_loss,
            params=self.engine.params,
            skipped_steps=p.skipped_steps,
            checkpoint=str(store.checkpoint_root(self.run_dir) / store.tag_for(cfg.train.steps)),
            loss_plot=str(loss_plot) if loss_plot else None,
            passkey=passkey,
            passkey_plot=str(passkey_plot) if passkey_plot else None,
        )
        if self.rank == 0:  # what a start of the finished run reports instead of training
            staging.write_json(self.run_dir / SUMMARY_FILE, asdict(summary))
        return summary

    def close(self) -> None:
        self.logger.close()


def train(cfg: Config, fresh: bool = False, resume: bool = False) -> Summary:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    run_dir, resuming, lock = choose_run_directory(cfg, fresh, resume, lock=rank == 0)
    try:
        done = completed_summary(run_dir, cfg) if resuming else None
        if done is not None:  # every rank reads the same files, so every rank stops here
            raise AlreadyComplete(done)
        trainer = Trainer(cfg, run_dir, resuming)
        try:
            return trainer.run()
        finally:
            trainer.close()
    finally:
        if lock is not None:
            lock.release()


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


def _check_passkey_lengths(tokenizer: Tokenizer, lengths: list[int]) -> None:
    """Refuse, before training, passkey lengths too short for the prompt under this tokenizer."""
    for i, n in enumerate(lengths):
        if not holds_passkey(tokenizer, n):
            raise ConfigError("<config>", f"eval.passkey_lengths[{i}]", f"{n} tokens cannot hold a passkey prompt")


def holds_passkey(tokenizer: Tokenizer, n: int) -> bool:
    try:
        passkey_sample(tokenizer, n - 8, 0.0, "12345")  # 8: room for the key's tokens
    except ValueError:
        return False
    return True


def _endless(loader) -> Iterator[dict]:
    """Batches across epoch boundaries; each pass over the streaming loader is one epoch. A pass that
    yields nothing is an error, not a wait."""
    while True:
        batches = 0
        for batch in loader:
            batches += 1
            yield batch
        if batches == 0:
            raise DataError("<data>", None, "the training data yielded no batch in a whole epoch")
