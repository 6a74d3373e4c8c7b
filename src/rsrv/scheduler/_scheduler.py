"""The dispatch engine: admission, the model registry and the dispatch loop.

Transport-agnostic: requests arrive as lists of numpy arrays through
:meth:`Scheduler.submit`, batches leave through an :class:`Executor`. One task
runs :meth:`Scheduler.run`, the only place that executes, so the device runs one
batch at a time. See specs/scheduler.md for the formulas.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import trio

from rsrv.config import SchedulerConfig
from rsrv.errors import (
    DeadlineExceeded,
    Internal,
    NotFound,
    ResourceExhausted,
    RsrvError,
    Unavailable,
)
from rsrv.scheduler._batching import assemble, check_count, split
from rsrv.scheduler._costs import CostTable, DecayedSum
from rsrv.scheduler._executor import Executor, Result
from rsrv.scheduler._model import ScheduledModel, VersionCounters
from rsrv.scheduler._policy import make_policy
from rsrv.scheduler._queue import Request, State, Version
from rsrv.scheduler._spec import ModelSpec, check_weight
from rsrv.scheduler._stats import SchedulingCounters, SchedulingStats, VersionStats

log = logging.getLogger("rsrv.scheduler")


@dataclass(eq=False, slots=True)
class Batch:
    """A planned dispatch: requests of one model version, in order."""

    model: ScheduledModel
    version: Version
    requests: list[Request]
    rows: int  # real rows; size - rows are padding
    size: int  # compiled batch size (0: unbatched)
    estimate: float  # learned cost of `size` when planned


class PinnedVersion:
    """A version of a model held by :meth:`Scheduler.pinned` for requests to come; a
    context manager whose exit lets it go (once)."""

    __slots__ = ("model", "version", "_release")

    def __init__(self, model: ScheduledModel, version: Version, release) -> None:
        self.model, self.version, self._release = model, version, release

    def __enter__(self) -> PinnedVersion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Let it go (later calls do nothing)."""
        if self._release is not None:
            release, self._release = self._release, None
            release(self.version)

    @property
    def label(self) -> str:
        return self.version.spec.version

    @property
    def key(self) -> object:
        """Its executor key (``ModelSpec.key``)."""
        return self.version.spec.key


def _any_late(reqs, now: float, costs: CostTable, size: int) -> bool:
    """Whether any of ``reqs`` would finish after its deadline in one batch of ``size``."""
    finish = now + costs.estimate(size)
    return any(r.deadline is not None and finish > r.deadline for r in reqs)


def _savable(models: Iterable[ScheduledModel], doomed: set[int], now: float) -> bool:
    """Whether some queued request of ``models`` (the backlogged ones), outside
    ``doomed`` (ids), can finish in time alone (edf: shedding the doomed ones then
    saves it time)."""

    def in_time(r: Request) -> bool:
        size = r.version.spec.size_for(r.rows)
        return id(r) not in doomed and not _any_late((r,), now, r.version.costs, size)

    return any(m.queue.any_queued(in_time) for m in models)


class Scheduler:
    """Queues requests per model and runs them on one executor, one batch at a time.

    Guarantees:

    * Every admitted request is answered exactly once: a :class:`Result`, or an
      ``RsrvError`` raised from :meth:`submit` (DeadlineExceeded, NotFound,
      Internal, Unavailable...). A submit cancelled while queued is withdrawn and
      never executed; one cancelled while executing leaves its batch running for
      the others.
    * A request runs on the model version it was admitted for (see
      :meth:`add_model`) and is never split across batches; padding never reaches it.
      Versions of one name with distinct labels (``ModelSpec.version``) are served
      side by side: one queue and one fair share for the name, a request runs on the
      label it names.
    * Selection touches only backlogged models: O(log b) per decision for b
      backlogged models, independent of how many are registered.
    * A model with a queue delay (``ModelSpec.max_queue_delay``, else the config's
      ``max_queue_delay_seconds``) whose queued rows would not fill ``max_rows`` waits
      up to that delay for more, unless a deadline, a latency budget or a drain says
      otherwise; meanwhile other models run (specs/scheduler.md, Queue delay).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        executor: Executor,
        *,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._config = config
        self._executor = executor
        # (an optional method of the executor, looked up once: see Executor)
        self._measured = getattr(executor, "measured_seconds", None)
        self._clock = clock
        self._policy = make_policy(config.discipline, config.ema_halflife_seconds)
        self._shed = config.discipline == "edf"  # shed requests that cannot finish in time
        self._models: dict[str, ScheduledModel] = {}
        self._holders: dict[str, int] = {}  # executor key -> versions holding it
        self._seq = itertools.count()
        self._index = itertools.count()
        self._queued = 0  # requests queued over all models
        self._running = False
        self._draining = False
        self._delayed = 0  # registered current versions with a queue delay
        self._hurry = False  # no queue delay any more: draining or stopping
        self._due: float | None = None  # when the idle loop must decide again: a held model
        self._closed = False
        self._wake = trio.Event()
        self._drained = trio.Event()

    # -- registry -------------------------------------------------------------------

    def add_model(self, spec: ModelSpec) -> None:
        """Register ``spec``, or make it the current version of its label
        (``spec.version``) of an existing model; other labels keep serving beside it.

        On replacement, requests already queued keep the version they were admitted
        for: each request is tagged with its version, batches never mix versions,
        and the old version's executor key (``ModelSpec.key``) runs them. The queue,
        statistics and fair-share position belong to the name and carry over; the
        weight is the new spec's, costs start from the new version's (seed them with
        :meth:`warm_costs`). The spec added last is the default of requests that name
        no label.
        """
        delay = spec.max_queue_delay
        if delay is None:
            delay = self._config.max_queue_delay_seconds
        version = Version(spec, CostTable(self._config.cost_ema_alpha), delay)
        self._delayed += delay > 0
        self._holders[spec.key] = self._holders.get(spec.key, 0) + 1
        label = spec.version
        m = self._models.get(spec.name)
        if m is None:
            usage = DecayedSum(self._config.ema_halflife_seconds)
            m = ScheduledModel(spec.name, next(self._index), version, spec.weight, usage)
            m.versions[label] = version
            m.counters[label] = VersionCounters()
            self._models[spec.name] = m
            return
        old = m.versions.pop(label, None)
        m.versions[label] = version  # last: the default
        m.counters.setdefault(label, VersionCounters())
        m.version = version
        if spec.weight != m.weight:  # (service so far keeps its size in device seconds)
            self._policy.reweight(m, spec.weight, self._clock())
            m.weight = spec.weight
        if old is not None:
            self._delayed -= old.delay > 0
            self._retire(old)
        self._policy.update(m, self._clock())
        self._wake.set()  # (a held request's delay or budget may have changed)

    def remove_version(self, name: str, label: str) -> None:
        """Stop admitting requests for version ``label`` of ``name``; those already
        queued for it still run on it, and its executor key is retired once they are
        answered. Removing the only label is :meth:`remove_model`. Unknown names and
        labels are ignored."""
        m = self._models.get(name)
        if m is None or label not in m.versions:
            return
        if len(m.versions) == 1:
            self.remove_model(name)
            return
        old = m.versions.pop(label)
        self._delayed -= old.delay > 0
        m.counters.pop(label, None)
        if m.version is old:
            m.version = next(reversed(m.versions.values()))
        self._retire(old)
        self._policy.update(m, self._clock())
        self._wake.set()

    def remove_model(self, name: str) -> None:
        """Unregister ``name``; its queued requests fail with NotFound. A batch of it
        that is executing finishes. Unknown names are ignored."""
        m = self._models.pop(name, None)
        if m is None:
            return
        self._policy.discard(m)
        for req in m.queue.queued():
            self._unqueue(req, State.DONE)
            self._settle(req, error=NotFound(f"model {name!r} was unloaded"))
        for version in m.versions.values():
            self._delayed -= version.delay > 0
            self._retire(version)
        self._wake.set()

    def set_weight(self, name: str, weight: float) -> None:
        """Change a model's fair-share weight, effective from the next decision.
        Service it received beyond (or short of) its share so far keeps its size in
        device seconds. InvalidArgument outside [MIN_WEIGHT, MAX_WEIGHT]."""
        m = self._model(name)
        weight = check_weight(weight, f"model {name!r}")
        now = self._clock()
        self._policy.reweight(m, weight, now)
        m.weight = weight
        self._policy.update(m, now)

    def warm_costs(self, name: str, costs: dict[int, float], version: str | None = None) -> None:
        """Seed a current version's per-size cost estimates (e.g. from warm-up runs):
        label ``version``'s, or the default's."""
        m = self._model(name)
        m.version_of(version).costs.seed(costs)
        self._policy.update(m, self._clock())
        self._wake.set()  # (a held request may no longer afford its wait)

    def spec(self, name: str, version: str | None = None) -> ModelSpec:
        """The current spec of ``name`` (of its label ``version``, or the default's);
        NotFound if unknown."""
        return self._model(name).version_of(version).spec

    def queue_delay(self, name: str, version: str | None = None) -> float:
        """Seconds a batch of the current version of label ``version`` (None: the
        default's) may wait for more requests: its spec's ``max_queue_delay``, else the
        config's ``max_queue_delay_seconds``; NotFound if unknown."""
        return self._model(name).version_of(version).delay

    def version_stats(self, name: str, version: str) -> VersionStats:
        """Executions of label ``version`` of ``name`` since it was added (a
        replacement of the label keeps counting); NotFound if unknown."""
        return self._model(name).version_stats(version)

    def stats(self, name: str) -> SchedulingStats:
        """:meth:`counters`, with the batch sizes, failures, queue waits, usage and
        costs; NotFound if unknown."""
        return self._model(name).stats_at(self._clock())

    def counters(self, name: str) -> SchedulingCounters:
        """The counters of :meth:`stats` alone (no percentiles, no copies); NotFound if
        unknown."""
        return self._model(name).counters_now()

    def _model(self, name: str) -> ScheduledModel:
        m = self._models.get(name)
        if m is None:
            raise NotFound(f"unknown model {name!r}")
        return m

    # -- admission ------------------------------------------------------------------

    def pinned(self, name: str, version: str | None = None) -> PinnedVersion:
        """The current version of label ``version`` of ``name`` (None: the default's),
        held while the block runs, for the work between choosing a version and queueing
        on it (a preprocess hook): a request submitted with it runs on that version
        even if the label was replaced or removed meanwhile, as if it had been queued
        already, and the version's executor key is retired only once the block has
        exited and its requests are answered. Such a request fails NotFound if the
        model was unloaded meanwhile. Raises NotFound (unknown model or label).
        (A context manager of its own, cheaper than a generator's on the request path.)"""
        m = self._model(name)
        held = m.version_of(version)
        held.outstanding += 1
        return PinnedVersion(m, held, self._done_with)

    async def submit(
        self,
        model: str,
        inputs: Sequence[np.ndarray],
        *,
        deadline: float | None = None,
        rows: int | None = None,
        front: bool = False,
        version: str | PinnedVersion | None = None,
    ) -> Result:
        """Queue one request and wait for its answer.

        ``inputs`` are the executable inputs in order; ``rows`` their extent along
        the batch axis (computed when None; all inputs must agree). ``deadline`` is
        absolute in the scheduler clock. ``front`` orders the request ahead of fresh
        work (meta sub-calls). ``version`` is the label to run on (None: the default),
        or a version :meth:`pinned` holds.
        Raises NotFound (unknown model or label), InvalidArgument (bad inputs, too many
        rows), ResourceExhausted (queue full), DeadlineExceeded (deadline or dispatch
        timeout passed while queued, or shed under edf), Unavailable (draining), or
        the batch's execution error.
        """
        req = self._admit(model, inputs, deadline, rows, front, version)
        try:
            with trio.move_on_at(self._trio_time(req.expiry)):
                await req.done.wait()
            if req.state is State.QUEUED:  # its expiry came first
                self._fail_queued(req, self._expired(req, self._clock()))
            elif not req.done.is_set():  # executing: the answer is on its way
                await req.done.wait()
        except BaseException:
            if req.state is State.QUEUED:  # cancelled before dispatch: withdraw
                self._unqueue(req, State.DONE)
                self._settle(req, code="CANCELLED")
                self._refresh(req.model)
            elif req.state is State.RUNNING:  # its batch runs on, for no one
                req.abandoned = True
            raise
        return req.outcome()

    def _admit(
        self,
        model: str,
        inputs: Sequence[np.ndarray],
        deadline: float | None,
        rows: int | None,
        front: bool,
        label: str | PinnedVersion | None = None,
    ) -> Request:
        now = self._clock()
        if self._draining or self._closed:
            if (known := self._models.get(model)) is not None:  # (counted, as rejections are)
                known.stats.failed("UNAVAILABLE")
            raise Unavailable("server is shutting down")
        if isinstance(label, PinnedVersion) and self._models.get(model) is not label.model:
            raise NotFound(f"model {model!r} was unloaded")
        m = self._model(model)
        try:
            req = self._request(m, inputs, deadline, rows, front, now, label)
        except RsrvError as e:
            m.stats.failed(e.code)
            raise
        m.queue.push(req)
        req.version.outstanding += 1
        self._queued += 1
        self._policy.update(m, now)
        self._wake.set()
        return req

    def _request(
        self,
        m: ScheduledModel,
        inputs: Sequence[np.ndarray],
        deadline: float | None,
        rows: int | None,
        front: bool,
        now: float,
        label: str | PinnedVersion | None = None,
    ) -> Request:
        """Validate one request against ``m``'s current version of ``label`` (or the
        pinned version); not yet queued."""
        version = label.version if isinstance(label, PinnedVersion) else m.version_of(label)
        spec = version.spec
        name = m.name
        arrays = [np.asarray(x) for x in inputs]
        sig, n = spec.check_inputs(arrays, rows, name)
        depth = self._config.max_queue_depth
        if m.queue.live >= depth:
            raise ResourceExhausted(
                f"model {name!r}: queue is full ({m.queue.live} requests "
                f"queued, max_queue_depth {depth})"
            )
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(f"model {name!r}: the request's deadline has already passed")
        if self._shed and spec.latency_budget is not None:  # under edf the budget is a deadline
            budget = now + spec.latency_budget
            deadline = budget if deadline is None else min(deadline, budget)
        timeout = now + self._config.dispatch_timeout_seconds
        expiry = timeout if deadline is None else min(deadline, timeout)
        order = self._policy.order(front, expiry, next(self._seq))
        return Request(m, version, arrays, n, sig, now, deadline, expiry, order)

    # -- the dispatch loop ------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The dispatch loop: select, plan, execute, answer; one batch at a time.

        Returns after :meth:`drain` once nothing is queued (at once when it was drained
        before it ran: a stop during start-up). If cancelled or failing, the executing
        batch and every queued request are answered Unavailable, and the scheduler
        admits nothing more. RuntimeError when it is running already.
        """
        if self._running:
            raise RuntimeError("Scheduler.run runs once, in one task")
        if self._closed:  # (drained, or run, already: nothing is queued, nothing will be)
            task_status.started()
            return
        self._running = True
        try:
            async with trio.open_nursery() as background:  # prefetches
                task_status.started()
                while not (self._draining and self._queued == 0):
                    await trio.lowlevel.checkpoint()
                    batch = self._next_batch()
                    if batch is None:
                        due = self._due
                        if due is None:
                            await self._wake.wait()
                        else:  # a held model is due then, unless a submit comes first
                            self._due = None
                            with trio.move_on_at(self._trio_time(due)):
                                await self._wake.wait()
                        self._wake = trio.Event()
                        continue
                    self._prefetch(background, batch)
                    await self._execute(batch)
                background.cancel_scope.cancel()
        finally:
            self._running = False
            self._stop()

    def _next_batch(self) -> Batch | None:
        """The decision: select a model, plan its batch. Requests found expired or
        shed on the way are answered; no device work happens here.

        When some model has a queue delay (and the scheduler is not hurrying), a
        selected model that waits for more requests (``ScheduledModel.held_until``) is
        withheld from the policy for the rest of this decision and the next one is
        selected; if none is ready, ``_due`` is the earliest moment a withheld model is
        due."""
        now = self._clock()
        holding = self._delayed and not self._hurry
        held: list[tuple[ScheduledModel, object]] = []
        due = None
        try:
            while (m := self._policy.select(now)) is not None:
                until = m.held_until(now) if holding else None
                if until is not None:
                    held.append((m, self._policy.withhold(m)))
                    due = until if due is None else min(due, until)
                    continue
                batch = self._plan(m, now, held)
                if batch is not None:
                    self._policy.dispatched(m, batch.estimate)
                self._policy.update(m, now)
                if batch is not None:
                    return batch
            if holding:
                self._due = due
            return None
        finally:
            for m, token in held:
                self._policy.restore(m, token)

    def _plan(
        self, m: ScheduledModel, now: float, held: list[tuple[ScheduledModel, object]]
    ) -> Batch | None:
        """Take the longest prefix of ``m``'s queue that one batch can hold: same
        version and input signature, at most ``max_rows`` rows, never splitting a
        request. It runs at the smallest compiled size holding its rows. ``held``: the
        models withheld in this decision (still backlogged, for edf's shedding)."""
        queue = m.queue
        while True:
            taken: list[Request] = []
            rows = 0
            while (req := queue.pop()) is not None:
                if now >= req.expiry:
                    self._fail_queued(req, self._expired(req, now), refresh=False)
                    continue
                if taken:
                    head = taken[0]
                    spec = head.version.spec
                    if (
                        not spec.batched
                        or req.version is not head.version
                        or req.signature != head.signature
                        or rows + req.rows > spec.max_rows
                    ):
                        queue.restore(req)
                        break
                taken.append(req)
                rows += req.rows
            if not taken:
                return None
            version = taken[0].version
            spec, costs = version.spec, version.costs
            # edf sheds the requests that cannot finish in time even alone, unless no
            # other queued request could: then shedding saves nobody time, and the
            # earliest runs to refresh an estimate that may be stale (shed requests
            # never correct it).
            if self._shed:
                doomed = {
                    id(r) for r in taken if _any_late((r,), now, costs, spec.size_for(r.rows))
                }
                others = itertools.chain(self._policy.backlogged(), (h for h, _ in held))
                if doomed and _savable(others, doomed, now):  # shed, then plan again
                    for r in taken:
                        if id(r) in doomed:
                            size = spec.size_for(r.rows)
                            error = self._shed_error(r, now, size, costs.estimate(size))
                            self._fail_queued(r, error, refresh=False)
                        else:
                            queue.restore(r)
                    continue
                # the longest prefix that finishes in time at its own size
                while len(taken) > 1 and _any_late(taken, now, costs, spec.size_for(rows)):
                    last = taken.pop()
                    rows -= last.rows
                    queue.restore(last)  # (planned next, at a smaller size)
            size = spec.size_for(rows)
            estimate = costs.estimate(size)
            for r in taken:
                self._unqueue(r, State.RUNNING)
            return Batch(m, version, taken, rows, size, estimate)

    async def _execute(self, batch: Batch) -> None:
        """Run ``batch`` and answer its requests."""
        spec = batch.version.spec
        start = self._clock()
        waits = [start - r.enqueued for r in batch.requests]
        batch.model.stats.dispatched(batch.size, waits)
        counters = batch.model.counters.get(spec.version)
        if counters is not None:
            counters.dispatches += 1
            counters.batch_sizes[batch.size] += 1
        outputs: list[list[np.ndarray]] = []
        error: RsrvError | None = None
        try:
            if spec.batched:
                inputs = assemble(
                    [r.inputs for r in batch.requests], batch.rows, batch.size, spec.input_axes
                )
            else:
                inputs = list(batch.requests[0].inputs)
            raw = await self._executor.execute(spec.key, batch.size, inputs)
            if spec.batched:
                outputs = split(
                    raw, [r.rows for r in batch.requests], batch.size, spec.output_axes, spec.name
                )
            else:
                check_count(raw, len(spec.output_axes), spec.name)
                outputs = [list(raw)]
        except Exception as exc:
            if isinstance(exc, RsrvError):
                error = exc
            else:
                log.warning("model %s: execution failed", spec.name, exc_info=True)
                error = Internal(
                    f"model {spec.name!r}: execution failed: {type(exc).__name__}: {exc}"
                )
        except BaseException:  # the loop is being cancelled
            for r in batch.requests:
                self._settle(r, error=Unavailable("scheduler stopped during execution"))
            raise
        elapsed = self._clock() - start
        try:  # (before the answers: the last one may retire the key measured here)
            self._account(batch, elapsed, ok=error is None)
        finally:
            for i, r in enumerate(batch.requests):
                if error is None:
                    self._settle(r, result=Result(outputs[i], waits[i], elapsed, batch.size))
                else:  # a copy each: the waiters raise it concurrently
                    self._settle(r, error=copy.copy(error))

    def _account(self, batch: Batch, elapsed: float, *, ok: bool) -> None:
        now = self._clock()
        m = batch.model
        m.stats.compute_seconds += elapsed
        m.usage.add(elapsed, now)
        if ok:  # a failed run says little about the cost
            seconds = None
            if self._measured is not None:
                try:
                    seconds = self._measured(batch.version.spec.key, batch.size)
                except Exception:
                    log.warning(
                        "measured_seconds of %s failed", batch.version.spec.key, exc_info=True
                    )
            batch.version.costs.observe(batch.size, elapsed if seconds is None else seconds)
        self._policy.completed(m, batch.estimate, elapsed, now)
        self._refresh(m)

    def _prefetch(self, background: trio.Nursery, batch: Batch) -> None:
        """Tell the executor which model is expected to run after ``batch``."""
        prefetch = getattr(self._executor, "prefetch", None)
        if prefetch is None:
            return
        nxt = self._policy.select(self._clock())
        head = None if nxt is None else nxt.queue.peek()
        if head is None or head.version.spec.key == batch.version.spec.key:
            return

        async def run_prefetch(key: str) -> None:
            try:
                await prefetch(key)
            except Exception:
                log.warning("prefetch of %s failed", key, exc_info=True)

        background.start_soon(run_prefetch, head.version.spec.key)

    # -- shutdown -------------------------------------------------------------------

    def hurry(self) -> None:
        """Dispatch without queue delays from now on (a graceful stop has begun);
        admission is unchanged. :meth:`drain` implies it."""
        self._hurry = True
        self._wake.set()

    async def drain(self) -> None:
        """Stop admitting (new submits get Unavailable) and return once every queued
        request has been answered; :meth:`run` then returns. Needs :meth:`run`
        running (or starting later) when requests are queued. Queued requests are
        dispatched without queue delays."""
        self._draining = True
        self.hurry()
        if not self._running and self._queued == 0:
            self._closed = True
            self._drained.set()
        await self._drained.wait()

    def _stop(self) -> None:
        self._closed = True
        for m in list(self._policy.backlogged()):
            self._policy.discard(m)
            for req in m.queue.queued():
                self._unqueue(req, State.DONE)
                self._settle(req, error=Unavailable("scheduler stopped"))
        self._drained.set()

    # -- bookkeeping ----------------------------------------------------------------

    def _unqueue(self, req: Request, state: State) -> None:
        req.model.queue.leave(req, state)
        self._queued -= 1
        if self._draining:
            self._wake.set()

    def _refresh(self, m: ScheduledModel) -> None:
        """Re-key ``m`` in the policy, if it is still registered."""
        if self._models.get(m.name) is m:
            self._policy.update(m, self._clock())

    def _fail_queued(self, req: Request, error: RsrvError, *, refresh: bool = True) -> None:
        self._unqueue(req, State.DONE)
        self._settle(req, error=error)
        if refresh:
            self._refresh(req.model)

    def _settle(
        self,
        req: Request,
        result: Result | None = None,
        error: RsrvError | None = None,
        code: str | None = None,
    ) -> None:
        """Answer ``req`` (once) and count it."""
        if not req.answer(result, error):
            return
        stats = req.model.stats
        if req.abandoned:  # its caller was cancelled while its batch executed
            stats.failed("CANCELLED")
        elif result is not None:
            stats.requests += 1
            stats.rows += req.rows if req.version.spec.batched else 1
        else:
            stats.failed(code or (error.code if error else "UNKNOWN"))
        self._done_with(req.version)

    def _done_with(self, version: Version) -> None:
        """One request (or pin) of ``version`` less; a retired version's key is released
        after the last."""
        version.outstanding -= 1
        if version.retired and version.outstanding == 0:
            self._release(version)

    def _retire(self, version: Version) -> None:
        version.retired = True
        if version.outstanding == 0:
            self._release(version)

    def _release(self, version: Version) -> None:
        """A retired version needs its key no more: tell the executor once no version
        (of any model, registered or retired with requests left) holds the key."""
        key = version.spec.key
        left = self._holders[key] - 1
        if left:
            self._holders[key] = left
            return
        del self._holders[key]
        retire = getattr(self._executor, "retire", None)
        if retire is None:
            return
        try:
            retire(key)
        except Exception:
            log.warning("retire of %s failed", key, exc_info=True)

    def _expired(self, req: Request, now: float) -> DeadlineExceeded:
        waited = now - req.enqueued
        name = req.model.name
        if req.deadline is not None and now >= req.deadline:
            return DeadlineExceeded(
                f"model {name!r}: deadline exceeded after {waited:.3f}s in the queue"
            )
        return DeadlineExceeded(
            f"model {name!r}: waited {waited:.3f}s in the queue, longer "
            f"than dispatch_timeout_seconds "
            f"({self._config.dispatch_timeout_seconds:g}s)"
        )

    def _shed_error(self, req: Request, now: float, size: int, estimate: float) -> DeadlineExceeded:
        left = (req.deadline or now) - now
        return DeadlineExceeded(
            f"model {req.model.name!r}: cannot finish before its deadline "
            f"(batch size {size} takes about {estimate:.3f}s, "
            f"{left:.3f}s left); shed before execution"
        )

    def _trio_time(self, t: float) -> float:
        """``t`` (scheduler clock) on trio's clock."""
        if self._clock is trio.current_time or math.isinf(t):
            return t
        return trio.current_time() + (t - self._clock())
