"""What a run records: a progress bar, metrics.jsonl, wandb (offline unless configured), TensorBoard
events (logging.tensorboard), per-head BAM/SSMax parameters, and the MFU estimate. Only rank 0 records;
other ranks get a silent RunLogger. Messages go through megabam/log.py, which writes around the progress bar."""

import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from megabam import progress
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
        self.tensorboard = None
        if not enabled:
            return
        self.metrics_path = run_dir / "metrics.jsonl"
        if cfg.logging.progress_bar and not progress.quiet():  # --quiet (MEGABAM_QUIET) wins
            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if cfg.logging.wandb_mode != "disabled":
            self.wandb_run = _start_wandb(cfg, run_dir, wandb_id)
        if cfg.logging.tensorboard:
            self.tensorboard = TensorBoard(run_dir / "tensorboard", start_step)

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
        if self.tensorboard is not None:
            self.tensorboard.log(step, metrics)

    def image(self, tag: str, png: Path, step: int) -> None:
        """A figure the run drew (loss.png, passkey.png) into TensorBoard; wandb and metrics.jsonl do not take it."""
        if self.tensorboard is not None:
            self.tensorboard.image(tag, png, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _start_wandb(cfg: Config, run_dir: Path, wandb_id: str | None):
    import wandb  # imported here: it starts a service process, not needed by silent ranks

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=cfg.logging.wandb_project,
        entity=cfg.logging.wandb_entity,
        group=cfg.logging.wandb_group,
        tags=cfg.logging.wandb_tags,
        name=cfg.logging.wandb_name or cfg.run.name,
        dir=str(run_dir),
        mode=cfg.logging.wandb_mode,
        config=dataclasses.asdict(cfg),
        id=wandb_id,
        resume="allow" if wandb_id else None,
    )


# A per-head key of head_parameters: family (bam, ssmax), layer, head, quantity.
HEAD_KEY = re.compile(r"(\w+)/(layer\d+)/head\d+/(\w+)")


class TensorBoard:
    """RUN/tensorboard/: every metric under its metrics.jsonl (and wandb) name, so one name finds a value
    everywhere. Per-head values stay one scalar each, and a Custom Scalars layout draws the heads of a
    layer on one chart per quantity; add_scalars would make every head a TensorBoard run of its own
    (layers × heads × 4 entries in the run selector, mixed in with the runs being compared)."""

    def __init__(self, log_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # imported here: only runs that write events need it

        # Hides the events an earlier start wrote after start_step (after the checkpoint resumed from, or all
        # of a start that failed before its first), as metrics.jsonl drops those rows.
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1)
        self.layout_written = False

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if not self.layout_written and any(HEAD_KEY.fullmatch(k) for k in metrics):
            self.writer.add_custom_scalars(head_layout(metrics))
            self.layout_written = True

    def image(self, tag: str, png: Path, step: int) -> None:
        from PIL import Image  # matplotlib's dependency, which drew the PNG

        with Image.open(png) as picture:
            pixels = np.asarray(picture.convert("RGB"))
        self.writer.add_image(tag, pixels, step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


def head_layout(keys) -> dict:
    """Custom Scalars layout: a category per quantity ("bam theta_alpha"), in it a chart per layer with a
    line per head."""
    layout: dict = {}
    for key in keys:
        match = HEAD_KEY.fullmatch(key)
        if match:
            family, layer, quantity = match.groups()
            charts = layout.setdefault(f"{family} {quantity}", {})
            charts[layer] = ["Multiline", [rf"^{family}/{layer}/head\d+/{quantity}$"]]
    return layout
