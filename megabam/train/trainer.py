"""The training loop: data → DeepSpeed engine → metrics, evaluation and checkpoints."""
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
from megabam.data.loader import build_loader
from megabam.data.passkey import passkey_sample
from megabam.data.tokenizer import Tokenizer
from megabam.eval.passkey import passkey_accuracy
from megabam.train import checkpoint
from megabam.train.engine import build_engine, init_distributed
from megabam.train.logger import RunLogger, head_parameters, peak_tflops
from megabam.train.optim import lr_factor
from megabam.train.plot import plot_loss


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (never overwritten silently)."""


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
    checkpoint: str
    loss_plot: str
    passkey: dict[int, float]  # prompt length → share of keys retrieved

    def lines(self) -> list[str]:
        return [
            f"run directory   {self.run_dir}",
            f"parameters      {self.params:,}",
            f"steps           {self.steps}   tokens {self.tokens:,}",
            f"wall time       {self.wall_s:.1f} s   ({self.tokens_per_s:,.0f} tokens/s)",
            f"train loss      {self.final_loss:.4f} (mean of the last logged steps)",
            f"val loss        {self.val_loss:.4f}   (perplexity {math.exp(min(self.val_loss, 50)):.2f})",
            *(f"passkey @ {n:<6}  {acc:.0%} retrieved" for n, acc in self.passkey.items()),
            f"checkpoint      {self.checkpoint}",
            f"loss plot       {self.loss_plot}",
        ]


def run_directory(cfg: Config) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def check_run_directory(run_dir: Path, resume: bool) -> None:
    """A directory that already holds a run is only ever continued (--resume), never overwritten."""
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        raise RunDirError(f"{run_dir}: already holds a run; pass --resume to continue it or set run.name")


def train(cfg: Config, resume: bool = False) -> Summary:
    os.environ.setdefault("WANDB_MODE", cfg.logging.wandb_mode)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # Attention probabilities under a sharp prior underflow into denormals, which x86 CPUs multiply
    # ~100x slower than normal floats; flushing them to zero changes no result that matters.
    torch.set_flush_denormal(True)
    run_dir = run_directory(cfg)
    check_run_directory(run_dir, resume)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has checked the directory before rank 0 writes into it
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")

    data = _build_data(cfg, rank)
    tokenizer = Tokenizer(data.tokenizer_path)
    passkey_lengths = cfg.eval.passkey_lengths or [cfg.data.seq_len]
    _check_passkey_lengths(tokenizer, passkey_lengths if cfg.eval.passkey_samples else [])
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        shutil.copyfile(data.tokenizer_path, run_dir / "tokenizer.model")
    engine, _ = build_engine(cfg)
    checkpoint.use_weights_only_loading(engine)
    train_loader = build_loader(data.train_dir, micro_batch_size=cfg.train.micro_batch_size, shuffle=True,
                                seed=cfg.run.seed, num_workers=cfg.data.num_workers)
    val_loader = build_loader(data.val_dir, micro_batch_size=cfg.train.micro_batch_size, shuffle=False,
                              seed=cfg.run.seed, num_workers=0)

    meta = checkpoint.load(engine, run_dir) if resume else None
    start_step = meta["step"] if meta else 0
    if meta:
        train_loader.load_state_dict(meta["loader"])
    tokens_per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_len * world
    log = RunLogger(cfg, run_dir, start_step, meta.get("wandb_id") if meta else None, enabled=rank == 0)
    if meta:
        log.write(f"resumed from {checkpoint.checkpoint_root(run_dir) / checkpoint.latest_tag(run_dir)} at step {start_step}")

    model = engine.module
    flops_per_token = model.flops_per_token(cfg.data.seq_len)
    peak = peak_tflops(cfg.logging)
    batches = _endless(train_loader)
    recent_losses: list[float] = []
    interval_losses: list[float] = []
    val_loss = math.nan
    t_start = time.perf_counter()
    for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for _ in range(cfg.train.grad_accum):
            batch = {k: v.to(device) for k, v in next(batches).items()}
            loss = engine(batch["input_ids"], batch["labels"], batch["doc_ids"])
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
        dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / (cfg.train.grad_accum * world)
        step_s = time.perf_counter() - t0
        tokens_per_s = tokens_per_step / step_s
        lr = cfg.optim.lr * lr_factor(step, cfg.schedule, cfg.train.steps)
        done = step + 1
        log.step(done, loss_value, tokens_per_s, lr)
        recent_losses = (recent_losses + [loss_value])[-10:]
        interval_losses.append(loss_value)

        if done % cfg.logging.log_every == 0 or done == cfg.train.steps:
            # the mean over the interval: one step's loss swings with its batch's mix of documents
            metrics = {"loss": sum(interval_losses) / len(interval_losses), "lr": lr, "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                       "tokens_per_s": tokens_per_s, "tokens": done * tokens_per_step,
                       "tflops_per_device": tokens_per_s * flops_per_token / world / 1e12}
            if peak:
                metrics["mfu"] = metrics["tflops_per_device"] / peak
            metrics.update(head_parameters(model))
            log.log(done, metrics)
            interval_losses = []
        if (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done == cfg.train.steps:
            val_loss = evaluate(engine, val_loader, cfg.train.eval_batches, device)
            log.log(done, {"val_loss": val_loss})
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.train.steps:
            meta = {"tokens": done * tokens_per_step, "loader": train_loader.state_dict(),
                    "config": asdict(cfg), "tokenizer": str(run_dir / "tokenizer.model"), "wandb_id": log.wandb_id}
            checkpoint.save(engine, run_dir, done, meta)
    wall = time.perf_counter() - t_start
    passkey = {}
    if cfg.eval.passkey_samples and rank == 0:
        for n in passkey_lengths:
            passkey[n] = passkey_accuracy(model, tokenizer, n, cfg.eval.passkey_samples, cfg.run.seed, device)
        log.log(cfg.train.steps, {f"passkey_{n}": acc for n, acc in passkey.items()})
    dist.barrier()

    steps_run = cfg.train.steps - start_step
    summary = Summary(
        run_dir=str(run_dir), steps=cfg.train.steps, tokens=cfg.train.steps * tokens_per_step, wall_s=wall,
        tokens_per_s=steps_run * tokens_per_step / wall if steps_run else 0.0,
        final_loss=sum(recent_losses) / len(recent_losses) if recent_losses else math.nan, val_loss=val_loss,
        params=model.num_params(), checkpoint=str(checkpoint.checkpoint_root(run_dir) / str(checkpoint.latest_tag(run_dir))),
        loss_plot=str(run_dir / "loss.png"), passkey=passkey,
    )
    if rank == 0:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
    log.close()
    return summary


def _build_data(cfg: Config, rank: int):
    """Rank 0 builds (or finds cached) the default dataset; the others then read the cache."""
    cache_root = Path(cfg.data.cache_dir or os.environ.get("MEGABAM_CACHE") or "~/.cache/megabam").expanduser()

    def build():
        return build_default_dataset(
            cache_root, sample_len=cfg.data.seq_len + 1, vocab_size=cfg.model.vocab_size,
            corpus_bytes=cfg.data.corpus_bytes, passkey_fraction=cfg.data.passkey_fraction,
            val_fraction=cfg.data.val_fraction, seed=cfg.run.seed,
        )

    data = build() if rank == 0 else None
    dist.barrier()
    return data if data is not None else build()


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


@torch.no_grad()
def evaluate(engine, loader, max_batches: int, device: torch.device) -> float:
    """Mean validation loss over the first `max_batches` batches, averaged over data-parallel ranks."""
    engine.eval()
    total = torch.zeros(2, device=device)
    for i, batch in enumerate(loader):
        if i == max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        total[0] += engine(batch["input_ids"], batch["labels"], batch["doc_ids"]).float()
        total[1] += 1
    engine.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item() if total[1] > 0 else math.nan
