"""The scheduling mode as the gateway runs it: one object that routes each request and,
once per discovery round, learns from the workers' reports (and repacks).

* ``round_robin``: each model's replicas in turn (``_routing.RoundRobinRouter``).
* ``least_outstanding``: the replica with the least work in flight, work counted by
  ``work_basis`` (``_routing.LeastOutstandingRouter``).
* ``lpt_packing``: models placed on ``replicas`` workers each by longest-processing-time
  packing over measured load and weight bytes (``_placement``), repacked as the fleet
  computes (``_planner``), requests routed to fill one replica's batch before the next
  (``_fill``), a run's requests held until it is full (``_hold``).

The pure parts (costs, placement, routing, repack clock) take the time and the
measurements as arguments; this module feeds them from the fleet and the monotonic clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rsrv.config import SchedulingConfig
from rsrv.errors import InvalidArgument
from rsrv.gateway._costs import CostTracker, RoutingMeta, WorkerReport, resolve_halflife
from rsrv.gateway._fill import FillRouter, FillSettings, ModelFill, fill_mode_warning
from rsrv.gateway._fleet import Fleet
from rsrv.gateway._hold import RunHolds
from rsrv.gateway._peek import InferHead, WireError
from rsrv.gateway._placement import ALL_REPLICAS, PlacementPolicy, WorkerBudget
from rsrv.gateway._planner import PackingSettings, RepackOutcome, RepackPlanner
from rsrv.gateway._routing import (
    InflightLedger,
    LeastOutstandingRouter,
    RoundRobinRouter,
    Ticket,
)

__all__ = ["Scheduling", "packing_settings"]

log = logging.getLogger("rsrv.gateway")

#: Worker disciplines under which lpt_packing's batch filling pays off: a fair worker
#: interleaves models and breaks the runs the gateway builds.
PACKING_DISCIPLINES = frozenset({"fifo", "edf"})


def _replicas(value: int | str) -> int:
    return ALL_REPLICAS if value == "all" else int(value)


def packing_settings(config: SchedulingConfig) -> PackingSettings:
    """lpt_packing's knobs from the gateway file's ``scheduling`` block."""
    return PackingSettings(
        first_rebalance_compute_seconds=config.first_rebalance_compute_seconds,
        rebalance_compute_seconds=config.rebalance_compute_seconds,
        ema_halflife_compute_seconds=config.ema_halflife_compute_seconds,
        compaction_mode=config.compaction_mode,
        compaction_interval=config.compaction_interval,
        placement=PlacementPolicy(
            default_replicas=_replicas(config.default_replicas),
            replicas={
                name: _replicas(m.replicas)
                for name, m in config.models.items()
                if m.replicas is not None
            },
            hysteresis=config.hysteresis,
            forbid_memory_oversubscription=config.forbid_memory_oversubscription,
        ),
    )


def fill_settings(config: SchedulingConfig) -> FillSettings:
    return FillSettings(
        mode=config.routing_fill_mode,
        factor=config.routing_fill_factor,
        models={
            name: ModelFill(m.fill_mode, m.fill_factor)
            for name, m in config.models.items()
            if m.fill_mode is not None or m.fill_factor is not None
        },
    )


class Scheduling:
    """Routes requests over ``fleet`` in the configured mode (see the module docstring).

    :meth:`route` is the hot path; :meth:`tick` runs after every discovery round and
    returns the repack it ran (lpt_packing), whose compaction the gateway carries out.
    """

    def __init__(self, config: SchedulingConfig, fleet: Fleet, startup_wait: float = 0.0):
        """``startup_wait`` (lpt_packing): how long the first placement waits for every
        configured worker to report (0: it is made at the first round with one)."""
        self.config = config
        self.startup_wait = startup_wait
        self._waiting_since: float | None = None
        self.mode = config.mode
        self.fleet = fleet
        self.ledger = InflightLedger()
        self.meta = RoutingMeta()
        # worker -> (the discipline it last reported, the warning about it: "" when fine)
        self._disciplines: dict[str, tuple[str, str]] = {}
        self.planner: RepackPlanner | None = None
        self.holds: RunHolds | None = None  # lpt_packing: fill runs held until full
        self.repacks = 0
        self.moves = 0
        self.last_repack_unix: float | None = None
        if self.mode == "round_robin":
            self.router = RoundRobinRouter(self.ledger)
        elif self.mode == "least_outstanding":
            self.router = LeastOutstandingRouter(work_basis=config.work_basis, ledger=self.ledger)
        else:
            settings = packing_settings(config)
            self.planner = RepackPlanner(settings, now=time.monotonic())
            self.holds = RunHolds(config.routing_fill_hold_seconds)
            self.router = FillRouter(
                settings=fill_settings(config),
                policy=config.routing_policy,
                work_basis=config.work_basis,
                ledger=self.ledger,
            )
            for warning in self._fill_warnings():
                log.warning("%s", warning)
        self.tracker = CostTracker(
            halflife_compute_seconds=resolve_halflife(
                config.ema_halflife_compute_seconds, config.rebalance_compute_seconds
            )
        )

    @property
    def warnings(self) -> list[str]:
        """What GetSchedulingStatus reports: the fill settings in force now, and each
        worker found on a discipline that breaks lpt_packing's batches."""
        return [*self._fill_warnings(), *(w for _, w in self._disciplines.values() if w)]

    def _fill_warnings(self) -> list[str]:
        if not isinstance(self.router, FillRouter):
            return []
        settings = self.router.settings
        modes = [settings.mode, *(m.mode for m in settings.models.values() if m.mode)]
        return sorted({w for mode in modes if (w := fill_mode_warning(mode)) is not None})

    @property
    def needs_control(self) -> bool:
        """Whether discovery must read every worker's ModelControlStatus every round
        (costs, batch axes, budgets)."""
        return self.router.needs_control

    def route(self, model: str, head: InferHead | None, replicas: tuple[str, ...]) -> Ticket:
        """Raises InvalidArgument when the input giving the request's units does not
        parse (the head does; the inputs are read only here)."""
        units = 1
        if head is not None and self.router.needs_units:
            meta = self.meta.get(model)
            if meta is not None:
                try:
                    units = meta.units(head.input_shape)
                except WireError as e:
                    raise InvalidArgument(f"malformed ModelInferRequest: {e}") from None
        ticket = self.router.route(model, replicas, units)
        if ticket.run is not None and self.holds is not None:
            place = ticket.run
            outstanding = self.ledger.model_outstanding(model)
            ticket.hold = self.holds.gate(
                model, place.number, place.units, place.quantum, outstanding, place.opened
            )
        return ticket

    def tick(self) -> RepackOutcome | None:
        self._forget_gone()
        if not self.needs_control:
            return None
        ready = self.fleet.ready
        reports = [
            WorkerReport.from_response(w.name, w.control) for w in ready if w.control is not None
        ]
        delta = self.tracker.observe(reports)
        self.meta = self.tracker.snapshot()
        self.router.set_meta(self.meta)
        if self.planner is None:
            return None
        self._check_disciplines(reports)
        if self.planner.clock.repack_count == 0 and not self._may_place(reports):
            return None
        outcome = self.planner.tick(
            now=time.monotonic(),
            compute_seconds=max(delta.compute_seconds, 0.0),
            meta=self.meta,
            workers=[WorkerBudget(w.name, self.meta.budgets.get(w.name)) for w in ready],
            arrivals=self.ledger.arrivals(),
            holders=self.fleet.routes,
        )
        if outcome is not None:
            self._apply(outcome)
        return outcome

    def _forget_gone(self) -> None:
        """Drop what is kept per model (arrival counts and rates, costs, rotation and run
        state) for models no worker lists any more and with nothing in flight: model
        names come and go (explicit-mode loads), and a long-lived gateway must not keep
        every name it ever routed."""
        known = set(self.fleet.routes) | self.fleet.known_models()
        for model in (set(self.ledger.arrivals()) | set(self.meta.models)) - known:
            if self.ledger.model_outstanding(model):
                continue
            self.ledger.forget(model)
            self.router.forget(model)
            if self.holds is not None:
                self.holds.forget(model)
            self.tracker.forget_model(model)
            if self.planner is not None:
                self.planner.rates.forget(model)

    def _apply(self, outcome: RepackOutcome) -> None:
        assert isinstance(self.router, FillRouter)
        self.router.set_placement(outcome.result.assignment())
        self.repacks += 1
        self.moves += outcome.result.moved
        self.last_repack_unix = time.time()
        log.info("%s", outcome.summary())
        for worker in outcome.result.oversubscribed:
            log.warning(
                "lpt_packing: worker %s: assigned weight footprint %d bytes exceeds its "
                "weight budget of %d bytes; expect eviction churn",
                worker,
                outcome.result.assigned_bytes.get(worker, 0),
                self.meta.budgets.get(worker, 0),
            )

    def _may_place(self, reports: list[WorkerReport]) -> bool:
        """The first placement: once every configured worker has reported, or
        ``startup_wait`` seconds after the first round (0: at once)."""
        if self.startup_wait <= 0:
            return True
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        configured = {w.name for w in self.fleet.workers if not w.from_dns}
        return configured <= {r.worker for r in reports} or (
            now - self._waiting_since >= self.startup_wait
        )

    def _check_disciplines(self, reports: list[WorkerReport]) -> None:
        """When a worker first reports, and whenever its discipline changes (it was
        restarted with another): say loudly if it runs one that breaks the batches
        lpt_packing builds; the warning lasts as long as the discipline."""
        for report in reports:
            known = self._disciplines.get(report.worker)
            if known is not None and known[0] == report.discipline:
                continue
            warning = ""
            if report.discipline and report.discipline not in PACKING_DISCIPLINES:
                warning = (
                    f"lpt_packing needs workers on scheduler.discipline fifo or edf; worker "
                    f"{report.worker} runs {report.discipline!r}, which interleaves models "
                    "and breaks the batches the gateway fills"
                )
                log.error("%s", warning)
            self._disciplines[report.worker] = (report.discipline, warning)

    def forget_worker(self, worker: str) -> None:
        """``worker`` left the fleet (DNS): drop what is kept of it."""
        self.tracker.forget_worker(worker)
        self.ledger.forget_worker(worker)
        self._disciplines.pop(worker, None)

    def request_repack(self) -> int:
        """An operator repack at the next round (lpt_packing); its sequence number."""
        if self.planner is None:
            raise ValueError("repacking needs scheduling.mode lpt_packing")
        return self.planner.request_repack()

    def metrics(self) -> Iterator:
        loads = GaugeMetricFamily(
            "rsrv_gateway_worker_load",
            "Work in flight per worker, by the scheduling work basis",
            labels=["worker"],
        )
        for worker in self.fleet.workers:
            loads.add_metric([worker.name], self.ledger.load(worker.name))
        yield loads
        yield CounterMetricFamily(
            "rsrv_gateway_repacks", "lpt_packing repacks run", value=self.repacks
        )
        yield CounterMetricFamily(
            "rsrv_gateway_placement_moves",
            "Models moved to another worker by lpt_packing repacks",
            value=self.moves,
        )
        if self.holds is not None:
            yield CounterMetricFamily(
                "rsrv_gateway_held_requests",
                "Requests held at the gateway until their fill run was full (lpt_packing)",
                value=self.holds.held,
            )
            holds = CounterMetricFamily(
                "rsrv_gateway_run_holds",
                "Fill runs held, by how the hold ended: full, timeout, replaced",
                labels=["outcome"],
            )
            for outcome, count in self.holds.outcomes.items():
                holds.add_metric([outcome], count)
            yield holds
