"""What a run records: a progress bar, metrics.jsonl, wandb (offline unless configured), per-head
BAM/SSMax parameters, and the MFU estimate. Only rank 0 records; other ranks get a silent RunLogger.
Messages go through megabam/log.py, which writes around the progress bar."""

import dataclasses
import json
import logging
import math
import os
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from megabam.config.schema import Config, LoggingConfig
from megabam.plan.hardware import gpu_of_device

log = logging.getLogger(__name__)


def peak_tflops(cfg: LoggingConfig) -> float | None:
    """logging.peak_tflops, else the dense bf16 peak of a GPU the planner knows (megabam/plan/hardware.py)."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops
    if torch.cuda.is_available():
        gpu = gpu_of_device(torch.cuda.get_device_name())
        return gpu.peak_tflops if gpu else None
    return None


def head_parameters(blocks: list[tuple[int, nn.Module]]) -> dict[str, float]:
    """Each head's prior θ_α, β = θ_β and α (paper form: exp(θ_α) = α^−β, logged as ln α = −θ_α/θ_β,
    undefined where β = 0) and its SSMax s, keyed by layer and head, for the (layer, block) pairs given."""
    out: dict[str, float] = {}
    for layer, block in blocks:
        mixer = block.mixer
        prior = getattr(mixer, "prior", None)
        if prior is not None and isinstance(getattr(prior, "theta_beta", None), nn.Parameter):
            for h, (ta, tb) in enumerate(zip(prior.theta_alpha.tolist(), prior.theta_beta.tolist())):
                out[f"bam/layer{layer}/head{h}/theta_alpha"] = ta
                out[f"bam/layer{layer}/head{h}/beta"] = tb
                out[f"bam/layer{layer}/head{h}/ln_alpha"] = -ta / tb if abs(tb) > 1e-6 else math.nan
        if getattr(mixer, "ssmax_s", None) is not None:
            for h, s in enumerate(mixer.ssmax_s.tolist()):
                out[f"ssmax/layer{layer}/head{h}/s"] = s
    return out


class RunLogger:
    def __init__(self, cfg: Config, run_dir: Path, start_step: int, wandb_id: str | None, enabled: bool):
        self.enabled = enabled
        self.write_failed = False
        self.bar = None
        self.wandb_run = None
        if not enabled:
            return
        self.metrics_path = run_dir / "metrics.jsonl"
        if cfg.logging.progress_bar:
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if cfg.logging.wandb_mode != "disabled":
            self.wandb_run = _start_wandb(cfg, run_dir, wandb_id)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def step(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}", refresh=False)
            self.bar.update(1)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        try:
            # Per-head values (keys with a '/') go under "heads", NaN as null (strict JSON readers).
            row = {"step": step, **{k: v for k, v in metrics.items() if "/" not in k}}
            heads = {k: None if v != v else v for k, v in metrics.items() if "/" in k}
            with self.metrics_path.open("a") as f:
                f.write(json.dumps({**row, "heads": heads} if heads else row) + "\n")
        except OSError as e:  # a full disk: the rows after the last checkpoint are rewritten on resume
            if not self.write_failed:
                log.warning(f"{self.metrics_path}: cannot append ({e.strerror}); training goes on")
            self.write_failed = True
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _start_wandb(cfg: Config, run_dir: Path, wandb_id: str | None):
    import wandb  # imported here: it starts a service process, not needed by silent ranks

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=cfg.logging.wandb_project,
        name=cfg.run.name,
        dir=str(run_dir),
        mode=cfg.logging.wandb_mode,
        config=dataclasses.asdict(cfg),
        id=wandb_id,
        resume="allow" if wandb_id else None,
    )
