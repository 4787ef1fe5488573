"""The benchmarks' summary statistics, one definition each, on the standard library's ``statistics``.

* :func:`median`: :func:`statistics.median`, the middle value, or the mean of the two middle
  values of an even count;
* :func:`percentile`: :func:`statistics.quantiles` with ``method="inclusive"``, linear
  interpolation between the two closest ranks of the sorted values, the data taken as the whole
  population (NumPy's default ``"linear"``): for n sorted values ``x[0..n-1]`` the q-th percentile
  sits at rank ``q/100 * (n - 1)``, so p0 is the minimum, p50 the median and p100 the maximum;
* :func:`spread`: median, minimum and maximum of the values that are not None, rounded, as the
  benchmarks report "median (min-max) over seeds".

Example::

    percentile([1.0, 2.0, 3.0, 4.0], 90)     # 3.7: rank 0.9 * 3 = 2.7, between 3.0 and 4.0
    spread([2.0, None, 1.0, 4.0])            # {'median': 2.0, 'min': 1.0, 'max': 4.0}
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence


def median(values: Iterable[float]) -> float:
    """The median (see the module docstring); :class:`statistics.StatisticsError` if empty."""
    return statistics.median(values)


def percentile(values: Sequence[float], q: int) -> float:
    """The ``q``-th percentile, ``q`` an integer from 0 to 100, by linear interpolation between the
    closest ranks (``statistics.quantiles(values, n=100, method="inclusive")``)."""
    if isinstance(q, bool) or not isinstance(q, int) or not 0 <= q <= 100:
        raise ValueError(f"percentile {q!r} is not an integer from 0 to 100")
    if not values:
        raise statistics.StatisticsError("percentile of no values")
    if q == 0:  # quantiles() gives p1..p99 only, and needs two values
        return min(values)
    if q == 100 or len(values) == 1:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def spread(values: Iterable[float | int | None], digits: int = 3) -> dict[str, float | int | None]:
    """``{"median", "min", "max"}`` of the values that are not None, each rounded to ``digits``
    (the median as a float, the min and max keep their type); all None when there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": round(float(median(present)), digits), "min": round(min(present), digits),
            "max": round(max(present), digits)}
