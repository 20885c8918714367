"""Bootstrap intervals (megabam/eval/stats.py) against distributions worked out by hand."""

import math

import pytest

from megabam.eval.stats import bootstrap_mean


def test_one_seed_of_twenty_prompts_gives_the_binomial_percentiles():
    """One seed, 14 of 20 prompts right: a resample's mean is Binomial(20, 0.7)/20, whose 2.5 % and
    97.5 % points follow from its CDF (chosen where the CDF steps far across both levels, so 20,000
    resamples land on the same step)."""
    n, right = 20, 14
    cdf, acc = [], 0.0
    for k in range(n + 1):
        acc += math.comb(n, k) * 0.7**k * 0.3 ** (n - k)
        cdf.append(acc)
    low = next(k for k in range(n + 1) if cdf[k] >= 0.025) / n
    high = next(k for k in range(n + 1) if cdf[k] >= 0.975) / n
    assert (low, high) == (0.5, 0.9) and cdf[9] < 0.02 < 0.03 < cdf[10] and cdf[17] < 0.965 < 0.985 < cdf[18]
    got = bootstrap_mean([[1.0] * right + [0.0] * (n - right)], resamples=20_000)
    assert (got.mean, got.low, got.high) == (0.7, low, high)


def test_three_seeds_of_one_value_span_their_range():
    """One value per seed: a resample is 3 draws from {0.2, 0.5, 0.9}; all three the lowest has
    probability 1/27 = 3.7 % > 2.5 %, so the interval's ends are the extreme seeds."""
    got = bootstrap_mean([[0.2], [0.5], [0.9]])
    assert (got.mean, got.low, got.high) == pytest.approx((1.6 / 3, 0.2, 0.9))


def test_seeds_weigh_the_same_and_both_levels_are_redrawn():
    """The point estimate is the mean of the seeds' means, not of all prompts; a seed whose prompts
    all agree adds no spread of its own, so two such seeds give three possible means: 0, ½, 1 with
    probabilities ¼, ½, ¼, and the interval [0, 1]; prompts that disagree inside one seed widen a
    one-seed interval from a point."""
    assert bootstrap_mean([[1.0, 1.0, 1.0, 1.0], [0.0]]).mean == 0.5
    both = bootstrap_mean([[1.0] * 5, [0.0] * 5])
    assert (both.low, both.high) == (0.0, 1.0)
    assert str(bootstrap_mean([[1.0] * 4])) == "1.00 [1.00, 1.00]"
    mixed = bootstrap_mean([[1.0, 0.0] * 10])
    assert mixed.low < 0.5 < mixed.high


def test_an_empty_seed_is_refused():
    with pytest.raises(ValueError, match=r"sizes \[2, 0\]"):
        bootstrap_mean([[1.0, 0.0], []])
