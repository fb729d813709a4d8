"""Confidence intervals and paired tests for comparisons over seeds (scipy.stats).

A comparison of methods repeats each method over N seeds on the same clients and test sets. Per
client and overall, a method's perplexity is reported as the mean over seeds with a 95% Student-t
interval; a method is set against a reference by the paired relative difference
100 * (ppl_method / ppl_reference - 1) over every (seed, client) pair both ran, with its t
interval and the two-sided one-sample t-test's p-value (Student 1908; scipy.stats.ttest_1samp).
A difference is called significant when its 95% interval excludes zero (equivalently p < 0.05).
The pairs of one seed share that seed's global model, so they are not independent; the interval
over pairs is the one the issue asks for, and the tables also give the interval over seeds alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided confidence interval.

    Attributes:
        mean: the mean.
        half_width: the interval's half width (NaN for fewer than two values).
        n: the number of values.
        confidence: the confidence level, in (0, 1).
    """

    mean: float
    half_width: float
    n: int
    confidence: float = 0.95

    @property
    def low(self) -> float:
        """mean - half_width."""
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        """mean + half_width."""
        return self.mean + self.half_width

    def text(self, digits: int = 2) -> str:
        """The interval as text.

        Args:
            digits: the decimals shown.

        Returns:
            ``mean ± half`` (``mean`` alone for one value).
        """
        if math.isnan(self.half_width):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of values with its Student-t interval.

    Half width t_{(1+c)/2, n-1} * sd / sqrt(n), sd with n - 1 degrees of freedom.

    Args:
        values: the values.
        confidence: the confidence level c, in (0, 1).

    Returns:
        The interval (half width NaN for one value).

    Raises:
        ValueError: for no values or a confidence outside (0, 1).
    """
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values to average")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if x.size < 2:
        return Interval(float(x.mean()), math.nan, 1, confidence)
    sem = float(x.std(ddof=1)) / math.sqrt(x.size)
    half = float(stats.t.ppf((1 + confidence) / 2, x.size - 1)) * sem
    return Interval(float(x.mean()), half, int(x.size), confidence)


@dataclass(frozen=True)
class PairedDifference:
    """A paired comparison; `significant` says whether the interval excludes zero.

    Attributes:
        interval: the interval of the differences.
        p_value: the t-test's p-value (NaN for fewer than two pairs).
    """

    interval: Interval
    p_value: float

    @property
    def significant(self) -> bool:
        """The interval excludes zero (p < 1 - confidence)."""
        i = self.interval
        return not math.isnan(i.half_width) and (i.low > 0 or i.high < 0)

    def text(self, with_p: bool = False) -> str:
        """Render the difference as a table cell.

        Args:
            with_p: append the t-test's p-value.

        Returns:
            ``+1.23% [+0.45, +2.01]`` (and `` p=0.0067``), in bold when significant; the mean alone
            (``+1.23%``) without an interval.
        """
        i = self.interval
        if math.isnan(i.half_width):
            return f"{i.mean:+.2f}%"
        text = f"{i.mean:+.2f}% [{i.low:+.2f}, {i.high:+.2f}]" + (f" p={self.p_value:.2g}" if with_p else "")
        return f"**{text}**" if self.significant else text


def paired_difference(differences: Sequence[float], confidence: float = 0.95) -> PairedDifference:
    """Interval and two-sided one-sample t-test (H0: mean difference 0) of paired differences.

    A constant non-zero set of differences has p = 0; an all-zero one p = 1.

    Args:
        differences: the paired differences.
        confidence: the interval's confidence level, in (0, 1).

    Returns:
        The interval and the p-value (NaN for fewer than two differences).

    Raises:
        ValueError: for no differences or a confidence outside (0, 1).
    """
    x = np.asarray(list(differences), dtype=np.float64)
    interval = mean_interval(x, confidence)
    if x.size < 2:
        return PairedDifference(interval, math.nan)
    if float(x.std(ddof=1)) == 0.0:
        return PairedDifference(interval, 1.0 if float(x.mean()) == 0.0 else 0.0)
    return PairedDifference(interval, float(stats.ttest_1samp(x, 0.0).pvalue))


def relative_differences(method: dict[tuple[int, str], float], reference: dict[tuple[int, str], float]) -> list[float]:
    """The paired relative differences (%) of a method against a reference.

    Args:
        method: ``{(seed, client): value}`` of the method.
        reference: the same, of the reference.

    Returns:
        100 * (method / reference - 1) for every (seed, client) key both hold, in key order.

    Raises:
        ValueError: when they share no key (nothing to pair).
    """
    keys = sorted(set(method) & set(reference))
    if not keys:
        raise ValueError("no (seed, client) pair in common: the runs cannot be paired")
    return [100.0 * (method[k] / reference[k] - 1.0) for k in keys]
