"""Learned execution costs and decayed device usage."""

from __future__ import annotations

import math


class CostTable:
    """Execution seconds per compiled batch size: an exponential moving average.

    The first sample of a size is adopted as is; later ones move the estimate by
    ``alpha`` of their difference: ``c <- c + alpha * (x - c)``. A size never
    measured is estimated from the nearest measured size, scaled by the ratio of
    sizes (cost assumed proportional to rows), and 0 when nothing is known yet.
    """

    __slots__ = ("_alpha", "_ema")

    def __init__(self, alpha: float) -> None:
        self._alpha = alpha
        self._ema: dict[int, float] = {}

    def observe(self, size: int, seconds: float) -> None:
        prev = self._ema.get(size)
        self._ema[size] = seconds if prev is None else prev + self._alpha * (seconds - prev)

    def seed(self, costs: dict[int, float]) -> None:
        """Adopt measured costs (e.g. a warm-up run of every size) as the estimates."""
        for size, seconds in costs.items():
            self._ema[int(size)] = float(seconds)

    def estimate(self, size: int) -> float:
        cost = self._ema.get(size)
        if cost is not None:
            return cost
        if not self._ema:
            return 0.0
        near = min(self._ema, key=lambda s: (abs(s - size), s))
        return self._ema[near] * max(size, 1) / max(near, 1)

    def snapshot(self) -> dict[int, float]:
        return dict(sorted(self._ema.items()))


class DecayedSum:
    """A sum whose terms halve every ``halflife`` seconds, decayed lazily.

    Stores the value at the time of the last update: ``U(t) = U(t0) * 2^-((t-t0)/h)``
    plus any sample added since.
    """

    __slots__ = ("_halflife", "_value", "_stamp")

    def __init__(self, halflife: float) -> None:
        self._halflife = halflife
        self._value = 0.0
        self._stamp = 0.0

    def add(self, amount: float, now: float) -> None:
        self._value = self.at(now) + amount
        self._stamp = now

    def at(self, now: float) -> float:
        if self._value == 0.0:
            return 0.0
        return self._value * decay(now - self._stamp, self._halflife)


def decay(elapsed: float, halflife: float) -> float:
    """``2^(-elapsed / halflife)``, 1 for elapsed <= 0."""
    return math.exp2(-elapsed / halflife) if elapsed > 0 else 1.0
