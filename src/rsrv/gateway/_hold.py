"""Holding a fill run's requests at the gateway until the run is full.

A worker coalesces the queued requests of a model that reach it within its queue delay.
The requests of one run come through the gateway one after another, as their clients send
them; when they are spread over longer than the worker's delay, the worker splits the run
in two batches, and the halves come back apart and stay apart. With
``scheduling.routing_fill_hold_seconds`` (lpt_packing, fill mode ``run``), the requests
that open and join a run wait here until the run holds its quantum, or until the hold
time after it opened, whichever is first; then they go on together, and reach the worker
within a fraction of a millisecond of each other.

Whether a run is held is decided when it opens: only when it can be expected to fill,
the model having at least a quantum of units in flight (its own included), as
closed-loop clients whose answers are coming back do. A lone client is never held. A new
run releases the one before it. A request with a deadline waits at most half the time it
has left, however long the hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import trio

__all__ = ["RunGate", "RunHolds"]


class RunGate:
    """Where the requests of one run wait: until :meth:`open`, or ``deadline`` (trio
    time)."""

    __slots__ = ("deadline", "number", "outcome", "_holds", "_opened")

    def __init__(self, holds: RunHolds, number: int, deadline: float):
        self.number = number  # the run's number (FillRouter)
        self.deadline = deadline
        self.outcome: str | None = None  # how the hold ended, once it has
        self._holds = holds
        self._opened = trio.Event()

    @property
    def opened(self) -> bool:
        return self._opened.is_set()

    def open(self) -> None:
        self._opened.set()

    async def wait(self, until: float = math.inf) -> None:
        """Until the run is full or replaced, or its deadline; at once after either.
        A request leaves at ``until`` (trio time) if that comes first (its own limit),
        the hold going on for the others."""
        with trio.move_on_at(min(self.deadline, until)):
            await self._opened.wait()
        if not self.opened and trio.current_time() >= self.deadline:
            self._holds.ended(self, "timeout")


@dataclass
class RunHolds:
    """The gate of each model's current run, and counts of how holds ended: ``full``,
    ``timeout`` (the hold time passed first) or ``replaced`` (released first: a new run
    opened, the model left, the hold time was changed)."""

    seconds: float
    held: int = 0  # requests that waited at a gate
    outcomes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("full", "timeout", "replaced"), 0)
    )
    _gates: dict[str, RunGate] = field(default_factory=dict)

    def gate(
        self, model: str, run: int, units: int, quantum: int, outstanding: int, opened: bool
    ) -> RunGate | None:
        """The gate of a request routed into run number ``run`` of ``model`` (which it
        ``opened``, or joined), the run holding ``units`` of its ``quantum`` with it,
        while the model has ``outstanding`` units in flight; None when it goes on at
        once. Whether a run is held is decided when it opens."""
        gate = self._gates.get(model)
        if gate is not None and (opened or gate.number != run):  # the run it held is over
            self._retire(model, "replaced")
            gate = None
        if gate is None:
            if not opened or self.seconds <= 0 or units >= quantum or outstanding < quantum:
                return None  # not held: full already, or it cannot be expected to fill
            gate = self._gates[model] = RunGate(self, run, trio.current_time() + self.seconds)
        elif units >= quantum:  # full: it goes, and so do the requests held
            self._retire(model, "full")
            return None
        elif trio.current_time() >= gate.deadline:
            return None
        self.held += 1
        return gate

    def configure(self, seconds: float) -> None:
        """A new hold time; the runs held now go at once."""
        if seconds != self.seconds:
            self.seconds = seconds
            for model in list(self._gates):
                self._retire(model, "replaced")

    def forget(self, model: str) -> None:
        """``model`` is gone: release what waits for it."""
        if model in self._gates:
            self._retire(model, "replaced")

    def ended(self, gate: RunGate, outcome: str) -> None:
        """Count how ``gate``'s hold ended, the first time."""
        if gate.outcome is None:
            gate.outcome = outcome
            self.outcomes[outcome] += 1

    def _retire(self, model: str, outcome: str) -> None:
        gate = self._gates.pop(model)
        if gate.outcome is None and trio.current_time() >= gate.deadline:
            outcome = "timeout"  # (no request was left waiting to see it)
        self.ended(gate, outcome)
        gate.open()
