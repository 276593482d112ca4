"""Running summaries of a stream of floats in bounded memory: count, sum, min, max and quantiles within a known
relative error; what a run's record keeps of every steady step (``lit_ddp.records.schema``).

    from lit_ddp.records.sketch import Sketch
    s = Sketch.of([1.0, 2.0, 3.0]); s.median, s.quantile(0.9)
"""

import math
from collections.abc import Iterable
from typing import Any


class Sketch:
    """count, sum, min, max and quantiles of a stream of floats, in bounded memory.

    The quantile sketch is DDSketch's (Masson et al., VLDB 2019): a value x > 0 falls in bin
    ``ceil(log(x) / log(gamma))`` with ``gamma = (1 + a) / (1 - a)``, and a bin's representative is within a
    relative ``a`` of every value in it, so every quantile is within ``a`` of the exact one (negative values
    mirror, zeros count apart). Bins grow with the log of the value range, not with the count.
    """

    RELATIVE_ACCURACY = 0.005
    _GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
    _LOG_GAMMA = math.log(_GAMMA)

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self._bins: dict[int, int] = {}  # bin key -> count (see add: even keys positive, odd negative)
        self._zeros = 0

    __hash__ = None  # mutable; equal when they saw the same values (to the sketch's bins)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sketch) and self.to_json() == other.to_json()

    def add(self, value: float) -> None:
        if math.isnan(value):
            return
        self.count += 1
        self.total += value
        self.min, self.max = min(self.min, value), max(self.max, value)
        if value == 0:
            self._zeros += 1
            return
        key = math.ceil(math.log(abs(value)) / self._LOG_GAMMA)
        key = 2 * key if value > 0 else 2 * key + 1  # even: positive, odd: negative (>= alike: 0 returned above)
        self._bins[key] = self._bins.get(key, 0) + 1

    def _value(self, key: int) -> float:
        k, negative = divmod(key, 2)
        magnitude = 2 * self._GAMMA**k / (self._GAMMA + 1)  # the bin's centre in relative terms
        return -magnitude if negative else magnitude

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (0 <= q <= 1): the sketch's value for the ``floor(q (count - 1))``-th smallest value
        (for an even count, the median is the lower of the two middle ones), clamped to the exact min and max;
        NaN if empty."""
        if not self.count:
            return math.nan
        # Sorted by value: the bins' values are distinct, so key=None (the pairs) would sort them alike.
        values = sorted(((self._value(k), n) for k, n in self._bins.items()), key=lambda vn: vn[0])
        if self._zeros:
            values.append((0.0, self._zeros))
            values.sort(key=lambda vn: vn[0])
        rank = q * (self.count - 1)
        seen = 0
        for value, n in values:
            seen += n
            if seen > rank:
                return min(max(value, self.min), self.max)
        return self.max

    @property
    def median(self) -> float:
        return self.quantile(0.5)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total, "min": self.min if self.count else None,
                "max": self.max if self.count else None, "zeros": self._zeros,
                "bins": [[k, n] for k, n in sorted(self._bins.items())]}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Sketch":
        summary = cls()
        summary.count, summary.total, summary._zeros = data["count"], data["total"], data["zeros"]
        if summary.count:
            summary.min, summary.max = data["min"], data["max"]
        summary._bins = {int(k): int(n) for k, n in data["bins"]}
        return summary

    @classmethod
    def merged(cls, summaries: Iterable["Sketch"]) -> "Sketch":
        """One summary of all the values the ``summaries`` saw (the sketch merges exactly: bins add up)."""
        merged = cls()
        for s in summaries:
            merged.count, merged.total, merged._zeros = (
                merged.count + s.count,
                merged.total + s.total,
                merged._zeros + s._zeros,
            )
            merged.min, merged.max = min(merged.min, s.min), max(merged.max, s.max)
            for key, n in s._bins.items():
                merged._bins[key] = merged._bins.get(key, 0) + n
        return merged

    @classmethod
    def of(cls, values: Iterable[float]) -> "Sketch":
        summary = cls()
        for value in values:
            summary.add(value)
        return summary
