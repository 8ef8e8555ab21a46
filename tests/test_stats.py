"""mptrain/core/stats.py against scipy.stats and closed-form cases, on fixed samples."""
from __future__ import annotations

import math
import random

import pytest
import scipy.stats as st

from mptrain.core import stats

SAMPLES = [
    ([4.8144, 4.8171, 4.8090], [4.8168, 4.8190, 4.8133]),
    ([5.5262, 5.5301, 5.5590, 5.4950, 5.5112], [5.5190, 5.5293, 5.5549, 5.4909, 5.5100]),
    ([1.0, 2.0], [1.5, 1.0]),
    ([0.3, -0.1, 0.25, 0.7, 0.1, 0.0, 0.4, 0.05, 0.2, 0.33], [0.0] * 10),
]


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 19, 60, 1000])
def test_student_t_matches_scipy(df):
    for t in (-30.0, -4.2, -2.0, -0.5, 0.0, 0.3, 1.0, 2.571, 6.0, 50.0):
        assert stats.t_cdf(t, df) == pytest.approx(st.t.cdf(t, df), rel=1e-10, abs=1e-14)
    for q in (0.001, 0.025, 0.1, 0.5, 0.8, 0.975, 0.995, 0.9999):
        assert stats.t_quantile(q, df) == pytest.approx(st.t.ppf(q, df), rel=1e-9, abs=1e-12)


def test_closed_forms():
    # df=1 is the Cauchy distribution: P(T <= t) = 1/2 + atan(t)/pi; df=2: 1/2 + t / (2 sqrt(2 + t^2)).
    for t in (-3.0, 0.7, 12.0):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-12)
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), rel=1e-12)
    assert stats.t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-10)
    with pytest.raises(ValueError, match="0 < q < 1"):
        stats.t_quantile(1.0, 3)


@pytest.mark.parametrize("a,b", SAMPLES)
def test_paired_test_and_interval_match_scipy(a, b):
    c = stats.paired(a, b)
    ref = st.ttest_rel(a, b)
    assert c.p == pytest.approx(ref.pvalue, rel=1e-9)
    lo, hi = ref.confidence_interval(0.95)
    assert c.ci[0] == pytest.approx(lo, rel=1e-9) and c.ci[1] == pytest.approx(hi, rel=1e-9)
    assert c.mean == pytest.approx(sum(x - y for x, y in zip(a, b)) / len(a), rel=1e-12)
    assert c.resolved == (ref.pvalue < 0.05) == (lo > 0 or hi < 0)


def test_spread_matches_scipy():
    xs = [4.8144, 4.8171, 4.8090, 4.8201]
    s = stats.spread(xs)
    assert s.mean == pytest.approx(st.tmean(xs)) and s.sd == pytest.approx(st.tstd(xs))
    lo, hi = st.t.interval(0.95, len(xs) - 1, loc=s.mean, scale=st.sem(xs))
    assert s.ci == pytest.approx((lo, hi), rel=1e-10)
    assert (s.low, s.high) == (4.8090, 4.8201)
    one = stats.spread([3.0])
    assert one.sd is None and one.ci is None and "1 seed" in one.text()


def _exact_power(size: float, sd: float, n: int) -> float:
    """The paired t-test's power from the noncentral t distribution (both tails)."""
    crit = st.t.ppf(0.975, n - 1)
    nc = size / sd * math.sqrt(n)
    return st.nct.sf(crit, n - 1, nc) + st.nct.cdf(-crit, n - 1, nc)


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8, 1.0, 1.5, 2.5])
def test_seed_count_estimate_against_the_exact_power(ratio):
    n = stats.seeds_needed(ratio, 1.0)
    exact = next(k for k in range(2, 10_000) if _exact_power(ratio, 1.0, k) >= stats.POWER)
    assert abs(n - exact) <= 1, (ratio, n, exact)  # the central-t approximation: within a seed
    assert stats.seeds_needed(0.5, 1.0) == stats.seeds_needed(5.0, 10.0)  # only size/sd matters


def test_degenerate_cases_are_said_not_guessed():
    one = stats.paired([5.0], [4.9])
    assert one.ci is None and one.p is None and not one.resolved
    assert "cannot judge the noise" in stats.verdict(one)
    same = stats.paired([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same.p == 1.0 and not same.resolved and same.seeds_needed is None
    shifted = stats.paired([1.5, 2.5, 3.5], [1.0, 2.0, 3.0])  # the same +0.5 on every seed
    assert shifted.resolved and shifted.p == 0.0
    assert stats.seeds_needed(0.0, 1.0) == stats.MOST_SEEDS + 1
    with pytest.raises(ValueError, match="one value per seed"):
        stats.paired([1.0, 2.0], [1.0])


def test_verdict_words():
    worse = stats.paired([5.2, 5.31, 5.25, 5.4], [5.0, 5.1, 5.05, 5.2])
    text = stats.verdict(worse)
    assert text.startswith("resolved: +0.2") and "worse than the reference" in text and "95% CI" in text
    noisy = stats.paired([5.01, 4.98, 5.03], [5.0, 5.0, 5.0])
    text = stats.verdict(noisy)
    assert text.startswith("not resolved at 3 seeds") and "would resolve a difference of this size" in text
    assert "of 0.0100 nats" in stats.verdict(stats.paired([5.01, 4.98, 5.03], [5.0] * 3, size=0.01))


def test_a_against_a_resolves_at_the_nominal_rate():
    """Many comparisons of one setting with itself (the same distribution on both
    sides) must come out resolved about 5% of the time: no more (a test that calls
    noise a difference) and no fewer (one that never resolves anything)."""
    rng = random.Random(52)
    trials, resolved = 4000, 0
    for _ in range(trials):
        n = rng.choice((2, 3, 5, 8))
        seed_luck = [rng.gauss(5.0, 0.05) for _ in range(n)]  # shared by both sides: paired
        a = [x + rng.gauss(0, 0.003) for x in seed_luck]
        b = [x + rng.gauss(0, 0.003) for x in seed_luck]
        resolved += stats.paired(a, b).resolved
    rate = resolved / trials
    assert 0.04 <= rate <= 0.06, rate  # 4000 trials: the binomial sd is 0.0034
