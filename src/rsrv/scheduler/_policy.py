"""Disciplines: which backlogged model runs next.

A policy holds only models with queued requests (backlogged), in a
:class:`KeyedHeap`, so ``select`` is O(log b) for b backlogged models and the
number of registered models does not matter. The scheduler calls ``update``
whenever a model's queue, costs or weight change; the exact formulas are in
specs/scheduler.md.
"""

from __future__ import annotations

from collections.abc import Iterator

from rsrv.scheduler._costs import decay
from rsrv.scheduler._heap import KeyedHeap
from rsrv.scheduler._model import ScheduledModel


class Policy:
    """Base: the interface the dispatch loop uses."""

    def order(self, front: bool, expiry: float, seq: int) -> tuple:
        """A request's service order within its model's queue (smaller first).

        Meta sub-calls (``front``) go ahead of fresh work, then arrival order.
        """
        return (0 if front else 1, seq)

    def update(self, m: ScheduledModel, now: float) -> None:
        """Re-key ``m`` after a change, or drop it once nothing is queued."""
        raise NotImplementedError

    def discard(self, m: ScheduledModel) -> None:
        """Forget ``m`` (removed)."""
        raise NotImplementedError

    def select(self, now: float) -> ScheduledModel | None:
        """The model to serve next; no side effects beyond heap housekeeping."""
        raise NotImplementedError

    def backlogged(self) -> Iterator[ScheduledModel]:
        raise NotImplementedError

    def withhold(self, m: ScheduledModel) -> object:
        """Hide backlogged ``m`` from :meth:`select` within one decision (it waits for
        more requests); :meth:`restore` with the token returned brings it back. ``m``
        must not be updated in between."""
        raise NotImplementedError

    def restore(self, m: ScheduledModel, token: object) -> None:
        """Undo :meth:`withhold` (a discipline may charge the wait, see Fair)."""
        raise NotImplementedError

    def dispatched(self, m: ScheduledModel, estimate: float) -> None:
        """``m`` starts a batch expected to take ``estimate`` seconds."""

    def reweight(self, m: ScheduledModel, weight: float, now: float) -> None:
        """``m``'s weight is about to become ``weight``."""

    def completed(self, m: ScheduledModel, estimate: float, actual: float, now: float) -> None:
        """``m``'s batch took ``actual`` seconds."""


class HeadOrder(Policy):
    """``fifo`` and ``edf``: serve the model whose next request comes first.

    Requests are ordered by ``(front? 0 : 1, seq)`` under fifo, and by
    ``(front? 0 : 1, expiry, seq)`` under edf; a model's key is its head request's
    order, so the two disciplines differ only in that key.
    """

    def __init__(self, by_expiry: bool) -> None:
        self._by_expiry = by_expiry
        self._ready: KeyedHeap[ScheduledModel] = KeyedHeap()

    def order(self, front: bool, expiry: float, seq: int) -> tuple:
        if self._by_expiry:
            return (0 if front else 1, expiry, seq)
        return (0 if front else 1, seq)

    def update(self, m: ScheduledModel, now: float) -> None:
        head = m.queue.peek()
        if head is None:
            self._ready.discard(m)
        else:
            self._ready.set(m, head.order)

    def discard(self, m: ScheduledModel) -> None:
        self._ready.discard(m)

    def select(self, now: float) -> ScheduledModel | None:
        top = self._ready.peek()
        return None if top is None else top[1]

    def backlogged(self) -> Iterator[ScheduledModel]:
        return iter(self._ready)

    def withhold(self, m: ScheduledModel) -> object:
        return self._ready.take(m)

    def restore(self, m: ScheduledModel, token: object) -> None:
        self._ready.set(m, token)


class Fair(Policy):
    """Weighted fair sharing by virtual time, with latency-budget escalation.

    Each model carries a virtual start tag S (device seconds per unit weight).
    Selection: the least finish tag F = S + c / w, c the learned cost of the batch
    it would run. A dispatch advances the system virtual time V to S and charges
    S += seconds / w. A model that becomes backlogged restarts at
    S = V + max(0, S - V) * 2^(-idle / halflife): it banks no credit for idle time,
    and a lead it had (service beyond its share) fades with the usage half-life. Idle
    time starts when its last batch completes (a model whose batch is executing is
    not idle, even with nothing queued).

    Escalation: among backlogged models whose oldest request has a latency budget B (its
    version's), the one with the earliest latest-start E = oldest enqueue + B - c is
    served first when running the fair choice j first would start it too late:
    ``now + c_j >= E``.
    """

    def __init__(self, halflife: float) -> None:
        self._halflife = halflife
        self._ready: KeyedHeap[ScheduledModel] = KeyedHeap()  # key (F, index)
        self._urgent: KeyedHeap[ScheduledModel] = KeyedHeap()  # key (E, index), budgeted only
        self.vtime = 0.0

    def update(self, m: ScheduledModel, now: float) -> None:
        if not m.queue.live:
            if m in self._ready:
                m.idle_since = now
            self.discard(m)
            return
        if m not in self._ready:  # backlogged again; a model whose batch runs was not idle
            idle = 0.0 if m.running else now - m.idle_since
            m.tag = self.vtime + max(0.0, m.tag - self.vtime) * decay(idle, self._halflife)
        cost = m.next_cost()
        self._ready.set(m, (m.tag + cost / m.weight, m.index))
        # (the oldest request's own version: versions side by side may differ in budget)
        oldest = m.queue.oldest()
        budget = None if oldest is None else oldest.version.spec.latency_budget
        if budget is None:
            self._urgent.discard(m)
        else:
            self._urgent.set(m, (oldest.enqueued + budget - cost, m.index))

    def discard(self, m: ScheduledModel) -> None:
        self._ready.discard(m)
        self._urgent.discard(m)

    def select(self, now: float) -> ScheduledModel | None:
        top = self._ready.peek()
        if top is None:
            return None
        choice = top[1]
        urgent = self._urgent.peek()
        if urgent is not None and urgent[1] is not choice:
            (latest_start, _), candidate = urgent
            if now + choice.next_cost() >= latest_start:
                return candidate
        return choice

    def backlogged(self) -> Iterator[ScheduledModel]:
        return iter(self._ready)

    def withhold(self, m: ScheduledModel) -> object:
        return self._ready.take(m), self._urgent.take(m)

    def restore(self, m: ScheduledModel, token: object) -> None:
        # A model that waits for company banks no credit, as an idle one banks none:
        # its tag is at least V when it comes back (else a model that keeps waiting
        # while others run would fall ever further behind, then take the device).
        ready, urgent = token  # type: ignore[misc]
        if m.tag < self.vtime:
            m.tag = self.vtime
            ready = (m.tag + m.next_cost() / m.weight, m.index)
        self._ready.set(m, ready)
        if urgent is not None:
            self._urgent.set(m, urgent)

    def reweight(self, m: ScheduledModel, weight: float, now: float) -> None:
        # The tag's distance from V is service (or its lack) per unit weight: keep it
        # the same in device seconds under the new weight.
        m.tag = self.vtime + (m.tag - self.vtime) * m.weight / weight

    def dispatched(self, m: ScheduledModel, estimate: float) -> None:
        self.vtime = max(self.vtime, m.tag)
        m.tag += estimate / m.weight
        m.running = True

    def completed(self, m: ScheduledModel, estimate: float, actual: float, now: float) -> None:
        m.tag += (actual - estimate) / m.weight
        m.running = False
        if m not in self._ready:  # idle from now, not from when its queue emptied
            m.idle_since = now


def make_policy(discipline: str, halflife: float) -> Policy:
    if discipline == "fair":
        return Fair(halflife)
    if discipline in ("fifo", "edf"):
        return HeadOrder(by_expiry=discipline == "edf")
    raise ValueError(f"unknown scheduling discipline {discipline!r}")


__all__ = ["Fair", "HeadOrder", "Policy", "make_policy"]
