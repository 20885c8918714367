"""The per-step window sampler: identical on two real processes, frequencies within a stated bound,
an exact annealing boundary, and identical windows after a resume."""

import math

import pytest

from megabam.config.schema import WindowConfig
from megabam.train.window_sampler import WindowSampler

STEPS = 10_000


def paper_7b(seed=1234, total=STEPS, anneal=0.1):
    return WindowSampler(
        WindowConfig(windows=[128, 2048], probabilities=[0.25, 0.75], anneal_fraction=anneal), seed, total
    )


def test_empirical_frequency_within_five_sigma():
    sampler = paper_7b(anneal=0.0)
    draws = [sampler.window(t) for t in range(STEPS)]
    freq = draws.count(2048) / STEPS
    bound = 5 * math.sqrt(0.75 * 0.25 / STEPS)  # 0.0217
    assert abs(freq - 0.75) <= bound
    assert set(draws) == {128, 2048}


def test_anneal_boundary_is_exact():
    # Probability 1 on the short window: every drawn step is 128, every annealed one 2048.
    sampler = WindowSampler(WindowConfig(windows=[128, 2048], probabilities=[1.0, 0.0], anneal_fraction=0.1), 7, 1000)
    assert sampler.anneal_start == 900
    assert [sampler.window(t) for t in (0, 898, 899)] == [128, 128, 128]
    assert [sampler.window(t) for t in (900, 901, 999)] == [2048] * 3
    paper = paper_7b(total=1000)
    assert all(paper.window(t) == 2048 for t in range(900, 1000))
    assert {paper.window(t) for t in range(900)} == {128, 2048}


def test_anneal_window_and_fixed_window():
    s = WindowSampler(
        WindowConfig(windows=[64, 256], probabilities=[0.5, 0.5], anneal_fraction=0.5, anneal_window=512), 0, 10
    )
    assert [s.window(t) for t in range(5, 10)] == [512] * 5
    fixed = WindowSampler(WindowConfig(windows=[96], probabilities=[1.0], anneal_fraction=0.0), 0, 100)
    assert {fixed.window(t) for t in range(100)} == {96}
    assert "no annealing" in fixed.describe()


def test_resume_mid_run_draws_identically():
    uninterrupted = paper_7b()
    expected = [uninterrupted.window(t) for t in range(STEPS)]
    saved = uninterrupted.state_dict()
    resumed = paper_7b()  # a new process: same config and seed
    resumed.load_state_dict(saved)
    assert [resumed.window(t) for t in range(4321, STEPS)] == expected[4321:]
    # Out of order and repeated calls give the same answers: the draw is a function of (seed, step).
    assert [resumed.window(t) for t in (9000, 3, 3, 8999)] == [expected[t] for t in (9000, 3, 3, 8999)]


def test_load_refuses_a_different_sampler():
    with pytest.raises(ValueError, match="seed"):
        paper_7b(seed=1).load_state_dict(paper_7b(seed=2).state_dict())
    with pytest.raises(ValueError, match="probabilities"):
        WindowSampler(WindowConfig(), 1, 100).load_state_dict(paper_7b(seed=1, total=100).state_dict())


def test_seeds_give_different_sequences_and_logging_names_the_window():
    a, b = paper_7b(seed=1), paper_7b(seed=2)
    assert [a.window(t) for t in range(200)] != [b.window(t) for t in range(200)]
    assert a.describe(9500) == "window 2048 (step 9500, annealing)"
    assert "128 with p=0.25, 2048 with p=0.75" in a.describe()
