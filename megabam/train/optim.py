"""The optimizer (AdamW or RAdam), its parameter groups and the learning-rate schedules."""

import math

import torch
from torch import nn

from megabam.config.schema import OptimConfig, ScheduleConfig


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Four groups: decayed matrices; undecayed norms/biases; the BAM prior θ's and the SSMax s, each
    undecayed with its own learning-rate multiplier (a prior or s pulled toward 0 by weight decay
    would bias every head toward NoPE / a flat softmax)."""
    groups = {
        "decay": {"params": [], "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
        "no_decay": {"params": [], "weight_decay": 0.0, "lr_mult": 1.0},
        "prior": {"params": [], "weight_decay": 0.0, "lr_mult": cfg.prior_lr_mult},
        "ssmax": {"params": [], "weight_decay": 0.0, "lr_mult": cfg.ssmax_lr_mult},
    }
    for name, p in model.named_parameters():  # shared parameters are listed once
        if p.requires_grad:
            groups[group_of(name, p)]["params"].append(p)
    return [dict(g, name=k, lr=cfg.lr * g["lr_mult"]) for k, g in groups.items() if g["params"]]


def group_of(name: str, p: nn.Parameter) -> str:
    """The group of parameter `name`: a placeholder's own, else by name and shape."""
    if hasattr(p, "optimizer_group"):
        return p.optimizer_group
    if ".prior." in name:
        return "prior"
    if name.endswith("ssmax_s"):
        return "ssmax"
    return "decay" if p.ndim >= 2 else "no_decay"


PLACEHOLDER = "group_placeholder_"


def add_group_placeholders(stage: nn.Module, groups: set[str]) -> None:
    """Give pipeline stage `stage` a one-element zero parameter in each of the model's `groups` that it
    has no parameter of. DeepSpeed drops empty groups, and its ZeRO optimizer all-reduces one gradient
    norm per group over the model-parallel group, which spans the stages: stages with different
    numbers of groups (an mLSTM-only stage has no prior or SSMax) would wait on each other for ever.
    A placeholder gets no gradient (ZeRO counts it as zero), so it never moves, and no layer file holds
    it (DeepSpeed saves a stage layer by layer)."""
    mine = {group_of(name, p) for name, p in stage.named_parameters() if p.requires_grad}
    for group in sorted(groups - mine):
        placeholder = nn.Parameter(torch.zeros(1))
        placeholder.optimizer_group = group
        stage.register_parameter(PLACEHOLDER + group, placeholder)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW, or RAdam with AdamW's decoupled weight decay. Both keep the same state (step, exp_avg,
    exp_avg_sq), so checkpoints, resharding and the memory plan treat them alike."""
    groups, betas = param_groups(model, cfg), tuple(cfg.betas)
    if cfg.kind == "radam":
        return torch.optim.RAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, decoupled_weight_decay=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)


def lr_factor(step: int, cfg: ScheduleConfig, total_steps: int) -> float:
    """Multiplier of each group's peak learning rate for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    # wsd: warmup, stable at the peak, then a linear decay over the last decay_fraction of the steps
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = (step - decay_start + 1) / decay_steps
    return 1.0 - (1 - cfg.min_lr_ratio) * min(progress, 1.0)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int):
    """LambdaLR scales every group's own base lr, so the prior/SSMax multipliers survive."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
