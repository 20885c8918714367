"""Parameter groups and learning-rate schedules against values worked out by hand."""

import math

import pytest
import torch

from megabam.config import load_config
from megabam.model import Decoder
from megabam.train.optim import build_optimizer, build_scheduler, lr_factor, param_groups


def _cfg(*overrides):
    return load_config(
        None,
        [
            "model.vocab_size=64",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "optim.prior_lr_mult=10",
            "optim.ssmax_lr_mult=0.5",
            *overrides,
        ],
    )


def test_groups_decay_only_matrices_and_scale_prior_and_ssmax():
    cfg = _cfg()
    model = Decoder(cfg.model)
    groups = {g["name"]: g for g in param_groups(model, cfg.optim)}
    names = {id(p): n for n, p in model.named_parameters()}
    in_group = {k: sorted(names[id(p)] for p in g["params"]) for k, g in groups.items()}
    assert in_group["prior"] == sorted(f"blocks.{i}.mixer.prior.theta_{x}" for i in range(2) for x in ("alpha", "beta"))
    assert in_group["ssmax"] == ["blocks.0.mixer.ssmax_s", "blocks.1.mixer.ssmax_s"]
    assert all(n.endswith("weight") and "norm" not in n for n in in_group["decay"])
    assert all("norm" in n for n in in_group["no_decay"])
    assert groups["prior"]["weight_decay"] == groups["ssmax"]["weight_decay"] == groups["no_decay"]["weight_decay"] == 0
    assert groups["decay"]["weight_decay"] == cfg.optim.weight_decay
    assert groups["prior"]["lr"] == pytest.approx(10 * cfg.optim.lr)
    assert groups["ssmax"]["lr"] == pytest.approx(0.5 * cfg.optim.lr)
    # every trainable parameter lands in exactly one group; frozen θ_μ in none
    listed = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(listed) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    assert not any("theta_mu" in names[i] for i in listed)


def test_shared_prior_is_one_parameter_set():
    cfg = _cfg("model.attention.bam.shared_across_layers=true")
    model = Decoder(cfg.model)
    groups = {g["name"]: g for g in param_groups(model, cfg.optim)}
    assert len(groups["prior"]["params"]) == 2
    assert model.blocks[0].mixer.prior is model.blocks[1].mixer.prior


def test_cosine_schedule_values():
    cfg = _cfg("schedule.kind=cosine", "schedule.warmup_steps=10", "schedule.min_lr_ratio=0.1", "train.steps=110")
    s = cfg.schedule
    assert lr_factor(0, s, 110) == pytest.approx(0.1)
    assert lr_factor(9, s, 110) == pytest.approx(1.0)
    assert lr_factor(10, s, 110) == pytest.approx(1.0)
    assert lr_factor(60, s, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr_factor(110, s, 110) == pytest.approx(0.1)


def test_wsd_schedule_values():
    cfg = _cfg(
        "schedule.kind=wsd",
        "schedule.warmup_steps=5",
        "schedule.decay_fraction=0.2",
        "schedule.min_lr_ratio=0.0",
        "train.steps=100",
    )
    s = cfg.schedule
    assert lr_factor(4, s, 100) == pytest.approx(1.0)
    assert lr_factor(79, s, 100) == 1.0
    assert lr_factor(80, s, 100) == pytest.approx(1 - 1 / 20)
    assert lr_factor(99, s, 100) == pytest.approx(0.0)


def test_scheduler_keeps_group_multipliers():
    cfg = _cfg("schedule.warmup_steps=4", "train.steps=20")
    model = Decoder(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.schedule, cfg.train.steps)
    for step in range(6):
        for g in opt.param_groups:
            expected = cfg.optim.lr * g["lr_mult"] * lr_factor(step, cfg.schedule, cfg.train.steps)
            assert math.isclose(g["lr"], expected, rel_tol=1e-12)
        opt.step()
        sched.step()


def _radam_reference(p, grads, lr, betas, eps, weight_decay):
    """RAdam (Liu et al. 2020, Algorithm 2) with AdamW's decoupled weight decay, in float64 and plain
    Python: the moments' bias corrections, the variance's rectification r_t once ρ_t > 5, and an
    un-normalised momentum step before. ε is added to √v before its bias correction, as torch does
    (the paper has no ε)."""
    b1, b2 = betas
    rho_inf = 2 / (1 - b2) - 1
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    p = list(p)
    for t, g in enumerate(grads, start=1):
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        for i in range(len(p)):
            p[i] *= 1 - lr * weight_decay
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat = m[i] / (1 - b1**t)
            if rho > 5:
                r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
                p[i] -= lr * m_hat * r * math.sqrt(1 - b2**t) / (math.sqrt(v[i]) + eps)
            else:
                p[i] -= lr * m_hat
    return p


def test_radam_steps_as_the_paper_with_decoupled_decay():
    """optim.kind=radam: ten steps of the decayed group against the plain float64 algorithm; with
    betas (0.9, 0.95) ρ_t passes 5 at step 7, so both branches are taken."""
    cfg = _cfg("optim.kind=radam", "optim.lr=0.01", "optim.weight_decay=0.1")
    model = Decoder(cfg.model).double()
    opt = build_optimizer(model, cfg.optim)
    assert isinstance(opt, torch.optim.RAdam)
    w = next(p for p in model.parameters() if p.ndim == 2)
    start = w.detach().flatten()[:5].tolist()
    gen = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(10):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        grads.append(w.grad.flatten()[:5].tolist())
        opt.step()
    want = _radam_reference(start, grads, 0.01, tuple(cfg.optim.betas), cfg.optim.eps, 0.1)
    assert w.detach().flatten()[:5].tolist() == pytest.approx(want, rel=1e-10, abs=1e-12)
