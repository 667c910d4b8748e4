"""Expectations of a length profile (opd_patches/hooks/lengths.py) from its own parameters, and the sampling
error of n draws: what tests compare drawn lengths with (no figure copied from a docstring).

A draw is round(L) clipped to [1, cap], L log-normal with the profile's median m and sigma s:
P(L > x) = 1 - Phi(ln(x / m) / s).
"""

import math
from statistics import NormalDist, fmean, pstdev

from opd_patches.hooks import lengths

SE_BOUND = 4  # standard errors; the draws are deterministic (sha256 of their keys), so this never flakes


def above(spec: str, x: float) -> float:
    """P(L > x) under the profile `spec`."""
    median, sigma = lengths.parse(spec)
    return 1 - NormalDist().cdf(math.log(x / median) / sigma)


def capped_mean(spec: str, cap: float) -> float:
    """E[min(L, cap)] = m e^(s^2/2) Phi((ln(cap/m) - s^2) / s) + cap P(L > cap)."""
    median, sigma = lengths.parse(spec)
    z = math.log(cap / median) / sigma
    return median * math.exp(sigma**2 / 2) * NormalDist().cdf(z - sigma) + cap * above(spec, cap)


def assert_share(hits: int, n: int, p: float, what: str) -> None:
    """A count of n draws against its probability: within SE_BOUND binomial standard errors."""
    se = math.sqrt(p * (1 - p) / n)
    assert abs(hits / n - p) < SE_BOUND * se, f"{what}: {hits / n:.4f} drawn, {p:.4f} expected (SE {se:.4f})"


def assert_follows(spec: str, draws: list[int], cap: int) -> None:
    """Draws of `spec` at `cap` (cap above the median): the median, the share at the cap and the mean,
    each within SE_BOUND standard errors of len(draws) draws (+ half a token where rounding can move it)."""
    median, sigma = lengths.parse(spec)
    n = len(draws)
    assert max(draws) <= cap and min(draws) >= 1
    # the sample median's SE: 1 / (2 f(m) sqrt(n)), density at the median f(m) = 1 / (m s sqrt(2 pi))
    se = median * sigma * math.sqrt(math.pi / 2) / math.sqrt(n)
    drawn = sorted(draws)[n // 2]
    assert abs(drawn - median) < SE_BOUND * se + 0.5, f"median {drawn}, expected {median} (SE {se:.1f})"
    # a draw is at the cap when L rounds to it or above: L >= cap - 0.5
    assert_share(sum(d == cap for d in draws), n, above(spec, cap - 0.5), f"share at the cap {cap}")
    # rounding moves each draw, hence the mean, by at most half a token
    mean, se = fmean(draws), pstdev(draws) / math.sqrt(n)
    want = capped_mean(spec, cap)
    assert abs(mean - want) < SE_BOUND * se + 0.5, f"mean {mean:.1f}, expected {want:.1f} (SE {se:.1f})"
