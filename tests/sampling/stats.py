"""Goodness-of-fit checks with explicit bounds, shared by the sampling tests (no scipy).

A sample passes when (1) no draw lands on a zero-probability outcome, (2) Pearson's
chi-square test gives p >= ``P_VALUE``, and (3) the total variation between the
empirical and the expected distribution stays below a distribution-free bound that
a correct sampler exceeds with probability at most ``P_VALUE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: false-alarm probability of each check for a correct sampler (seeds are fixed anyway)
P_VALUE = 1e-6
#: pool chi-square cells whose expected count is below this
MIN_EXPECTED_COUNT = 5.0


@dataclass
class Fit:
    n: int  # samples
    tv: float  # total variation between empirical and expected distributions
    tv_bound: float  # tv_bound(n, support size)
    chi2: float
    df: int
    p_value: float  # chi-square survival function at chi2
    impossible: int  # samples on zero-probability outcomes

    @property
    def passes(self) -> bool:
        return self.impossible == 0 and self.p_value >= P_VALUE and self.tv <= self.tv_bound

    @property
    def fails_clearly(self) -> bool:
        """Both statistics reject (used by negative controls)."""
        return self.impossible > 0 or (self.p_value < P_VALUE and self.tv > self.tv_bound)


def tv_bound(n: int, num_outcomes: int, delta: float = P_VALUE) -> float:
    """Bretagnolle-Huber-Carol: P(TV(empirical, true) >= eps) <= 2^C exp(-2 n eps^2) for C outcomes.

    Solving 2^C exp(-2 n eps^2) = delta for eps gives the bound.
    """
    return math.sqrt((num_outcomes * math.log(2) + math.log(1 / delta)) / (2 * n))


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


def goodness_of_fit(
    samples: torch.Tensor,  # (n,) int64 outcomes in 0..C-1
    expected: torch.Tensor,  # (C,) probabilities (need not be exactly normalised)
) -> Fit:
    expected = expected.double() / expected.double().sum()
    n = samples.numel()
    if n == 0:
        raise ValueError("goodness_of_fit needs at least one sample")
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    support = expected > 0
    impossible = int(counts[~support].sum())
    tv = 0.5 * float((counts / n - expected).abs().sum())

    exp_counts = expected[support] * n
    obs_counts = counts[support]
    small = exp_counts < MIN_EXPECTED_COUNT
    if bool(small.any()):
        obs_counts = torch.cat([obs_counts[~small], obs_counts[small].sum()[None]])
        exp_counts = torch.cat([exp_counts[~small], exp_counts[small].sum()[None]])
        if exp_counts[-1] < MIN_EXPECTED_COUNT and exp_counts.numel() > 1:  # fold the pool into the smallest cell
            j = int(exp_counts[:-1].argmin())
            obs_counts[j] += obs_counts[-1]
            exp_counts[j] += exp_counts[-1]
            obs_counts, exp_counts = obs_counts[:-1], exp_counts[:-1]
    chi2 = float(((obs_counts - exp_counts) ** 2 / exp_counts).sum())
    df = exp_counts.numel() - 1
    p_value = chi2_sf(chi2, df) if df > 0 else 1.0
    return Fit(
        n=n,
        tv=tv,
        tv_bound=tv_bound(n, int(support.sum())),
        chi2=chi2,
        df=df,
        p_value=p_value,
        impossible=impossible,
    )
