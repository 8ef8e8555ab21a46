"""The statistics every comparison of runs uses, written once: spreads over seeds,
the paired test between two settings, its interval, and how many seeds a
difference needs before it can be told from noise.

Why paired: seed k of one setting and seed k of another start from the same
weights and see the same batches (``train.seed`` fixes both), so most of a
seed's luck is shared and cancels in the difference. The test is therefore on
the per-seed differences ``d_k = a_k - b_k``: Student's t with ``n - 1``
degrees of freedom, two-sided. A difference is *resolved* when its 95%
interval excludes zero (equivalently ``p < 0.05``); otherwise it is *not
resolved at n seeds*, never a win or a loss.

The seed-count estimate is the smallest ``n`` at which a paired test would
resolve a true difference of the given size (the observed one, by default)
with probability :data:`POWER`, taking the spread of the differences seen so
far as the truth. Power is computed with the usual central-t approximation
``P(T_{n-1} > t_crit - delta)`` (``delta = size / sd * sqrt(n)``, the far tail
ignored), which agrees with the exact noncentral-t answer to within a seed
for the sizes that matter here (tests/test_stats.py checks it against scipy).

Pure Python (``math`` only): the Student-t distribution is the regularized
incomplete beta function, evaluated by its continued fraction, so mptrain does
not need scipy at run time; the tests compare every function with
``scipy.stats``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

CONFIDENCE = 0.95
"""The two-sided confidence of every interval, and ``1 - CONFIDENCE`` the test's level."""
POWER = 0.8
"""The chance a seed-count estimate gives of resolving a difference of the stated size."""
MOST_SEEDS = 10_000
"""Beyond this a seed-count estimate says "more than" instead of a number."""


# ---------------------------------------------------------------- Student's t
def _beta_cf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use the symmetry on the other
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * beta_inc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The ``t`` with ``t_cdf(t, df) == q`` (``0 < q < 1``), by bisection to double precision."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"a quantile needs 0 < q < 1, got {q}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2.0


@functools.lru_cache(maxsize=4096)
def _t_crit(n: int, confidence: float) -> float:
    """The two-sided critical value of a mean over ``n`` samples (cached: the seed-count
    search asks for the same few again and again)."""
    return t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1)


# ---------------------------------------------------------------- one setting
@dataclass(frozen=True)
class Spread:
    """A figure over a setting's seeds."""

    n: int
    mean: float
    sd: Optional[float]
    """The sample standard deviation (``n - 1``); None for one seed."""
    low: float
    high: float
    """The smallest and largest seed."""
    ci: Optional[tuple[float, float]]
    """The interval of the mean at :data:`CONFIDENCE`; None for one seed."""

    def text(self, spec: str = ".4f") -> str:
        """``4.8144 ± 0.0031 (sd, 3 seeds)``, or ``4.8144 (1 seed)``."""
        if self.sd is None:
            return f"{self.mean:{spec}} (1 seed)"
        return f"{self.mean:{spec}} ± {self.sd:{spec}} (sd, {self.n} seeds)"


def spread(values: Sequence[float]) -> Spread:
    """Mean, standard deviation, range and the mean's interval of ``values`` (one per seed)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("a spread needs at least one value")
    n, mean = len(xs), math.fsum(xs) / len(xs)
    if n == 1:
        return Spread(1, mean, None, mean, mean, None)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = _t_crit(n, CONFIDENCE) * sd / math.sqrt(n)
    return Spread(n, mean, sd, min(xs), max(xs), (mean - half, mean + half))


# ---------------------------------------------------------------- two settings
@dataclass(frozen=True)
class Paired:
    """A setting against a reference over the seeds both ran: ``a - b`` per seed."""

    n: int
    mean: float
    """The mean per-seed difference (setting minus reference)."""
    sd: Optional[float]
    """The differences' sample standard deviation; None for one seed."""
    ci: Optional[tuple[float, float]]
    """The mean difference's interval at :data:`CONFIDENCE`; None for one seed."""
    p: Optional[float]
    """The two-sided p-value of "no difference"; None for one seed."""
    size: float
    """The difference the seed-count estimate is for (the observed one unless given)."""
    seeds_needed: Optional[int]
    """Paired seeds that would resolve ``size`` with probability :data:`POWER`;
    None where the spread is unknown (one seed) or zero, ``MOST_SEEDS + 1`` beyond reach."""

    @property
    def resolved(self) -> bool:
        """The interval excludes zero (``p`` below ``1 - CONFIDENCE``)."""
        return self.p is not None and self.p < 1.0 - CONFIDENCE


def paired(a: Sequence[float], b: Sequence[float], size: Optional[float] = None) -> Paired:
    """The paired comparison of ``a`` (a setting, one value per seed) with ``b`` (the
    reference, the same seeds in the same order). ``size``: the difference to estimate
    the seed count for (default: the observed mean difference)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need one value per seed on each side, got {len(a)} and {len(b)}")
    if not a:
        raise ValueError("a paired comparison needs at least one seed")
    d = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    s = spread(d)
    want = abs(s.mean if size is None else float(size))
    if s.sd is None:
        return Paired(1, s.mean, None, None, None, want, None)
    if s.sd == 0.0:
        # Every seed moved by exactly the same amount: a deterministic difference
        # (or none at all), which no number of seeds makes more certain.
        p = 1.0 if s.mean == 0.0 else 0.0
        return Paired(s.n, s.mean, 0.0, (s.mean, s.mean), p, want, None)
    t = s.mean / (s.sd / math.sqrt(s.n))
    p = 2.0 * t_cdf(-abs(t), s.n - 1)
    return Paired(s.n, s.mean, s.sd, s.ci, p, want, seeds_needed(want, s.sd))


def power(size: float, sd: float, n: int, confidence: float = CONFIDENCE) -> float:
    """The chance a paired test over ``n`` seeds resolves a true mean difference ``size``
    whose per-seed differences spread by ``sd`` (central-t approximation; module doc)."""
    if n < 2:
        return 0.0
    delta = abs(size) / sd * math.sqrt(n)
    return 1.0 - t_cdf(_t_crit(n, confidence) - delta, n - 1)


def seeds_needed(size: float, sd: float, want: float = POWER) -> Optional[int]:
    """The fewest paired seeds (at least 2) at which :func:`power` reaches ``want``;
    None for a zero ``sd`` (nothing to resolve against), ``MOST_SEEDS + 1`` when even
    :data:`MOST_SEEDS` would not do (a size of zero, or one tiny against the spread)."""
    if sd == 0.0:
        return None
    if size == 0.0 or power(size, sd, MOST_SEEDS) < want:
        return MOST_SEEDS + 1
    lo, hi = 2, 2
    while power(size, sd, hi) < want:  # power grows with n: double, then bisect
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power(size, sd, mid) < want else (lo, mid)
    return lo


# ---------------------------------------------------------------- in words
def _signed(x: float, spec: str) -> str:
    return f"{x:+{spec}}"


def _p_text(p: float) -> str:
    return "p < 0.0001" if p < 1e-4 else f"p = {p:.2g}" if p < 0.01 else f"p = {p:.2f}"


def _seeds_text(n: Optional[int]) -> str:
    if n is None:
        return ""
    return f"more than {MOST_SEEDS:,} seeds" if n > MOST_SEEDS else f"about {n} seeds"


def verdict(c: Paired, unit: str = "nats", spec: str = ".4f", worse: str = "higher",
            unresolved: str = "not resolved") -> str:
    """``c`` in words, the interval and p-value with it. ``worse``: which sign of the
    difference is the setting's loss ("higher": a higher value is worse, as a loss);
    ``unresolved``: the words an unresolved difference opens with, before "at N seeds"
    (the advisor's "no measurable difference")."""
    if c.n < 2:
        return (f"{_signed(c.mean, spec)} {unit} at 1 seed: cannot judge the noise; "
                "rerun with two or more seeds (train.seed=0,1,2) to resolve it")
    lo, hi = c.ci
    interval = f"95% CI {_signed(lo, spec)} to {_signed(hi, spec)}, {_p_text(c.p)}, {c.n} paired seeds"
    if c.resolved:
        if c.mean == 0.0:
            return f"resolved: no difference ({interval})"
        better = (c.mean < 0) == (worse == "higher")
        return (f"resolved: {_signed(c.mean, spec)} {unit}, {'better' if better else 'worse'} "
                f"than the reference ({interval})")
    size = "of this size" if c.size == abs(c.mean) else f"of {c.size:{spec}} {unit}"
    need = _seeds_text(c.seeds_needed)
    hint = f"; {need} would resolve a difference {size}" if need else ""
    return f"{unresolved} at {c.n} seeds: {_signed(c.mean, spec)} {unit} ({interval}){hint}"
