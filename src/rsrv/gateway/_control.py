"""``rsrv.gateway.v1.GatewayControl``: the gateway's scheduling, seen and steered live.

GetSchedulingStatus answers in every mode. SetSchedulingPolicy, SetModelPlacement and
Repack steer lpt_packing and answer FAILED_PRECONDITION in the other modes. A change
is validated whole before anything is applied (one bad field: nothing changes) and is
not persisted: a restarted gateway starts from its file again.
"""

from __future__ import annotations

import math
import time

import msgspec
import trio

from rsrv.config import MAX_FILL_FACTOR, ConfigError, ModelPlacementConfig, SchedulingConfig
from rsrv.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rsrv.gateway._discovery import Discovery
from rsrv.gateway._fill import INFLIGHT_WARNING, FillRouter, fill_quantum
from rsrv.gateway._placement import ALL_REPLICAS
from rsrv.gateway._scheduling import Scheduling, fill_settings, packing_settings
from rsrv.gateway._status import model_views, worker_views
from rsrv.protocol.generated.rsrv.gateway.v1 import gateway_pb2 as pb
from rsrv.transport import Method, ServerCall, request_decoder

__all__ = ["GatewayControl"]

SERVICE = "/rsrv.gateway.v1.GatewayControl/"
MAX_WAIT_SECONDS = 120.0
#: SchedulingPolicy fields and the SchedulingConfig keys they set.
_POLICY_FIELDS = {
    "rebalance_compute_seconds": "rebalance_compute_seconds",
    "first_rebalance_compute_seconds": "first_rebalance_compute_seconds",
    "hysteresis": "hysteresis",
    "ema_halflife_compute_seconds": "ema_halflife_compute_seconds",
    "default_replicas": "default_replicas",
    "routing_policy": "routing_policy",
    "routing_fill_mode": "routing_fill_mode",
    "routing_fill_factor": "routing_fill_factor",
    "routing_fill_hold_seconds": "routing_fill_hold_seconds",
    "compaction_mode": "compaction_mode",
    "compaction_interval": "compaction_interval",
    "forbid_memory_oversubscription": "forbid_memory_oversubscription",
    "work_basis": "work_basis",
}
_STARTUP_ONLY = {
    "mode": "the scheduling mode is chosen at startup",
    "endpoints": "the workers are fixed at startup",
    "listen": "the listening addresses are fixed at startup",
    "generation": "the generation is counted by the gateway",
}


def _method(name: str, handler, request_type) -> Method:
    return Method(
        path=SERVICE + name,
        handler=handler,
        decode=request_decoder(request_type),  # malformed: INVALID_ARGUMENT
        encode=lambda message: message.SerializeToString(),
    )


class GatewayControl:
    """The control service of one gateway; :meth:`methods` is its table."""

    def __init__(self, scheduling: Scheduling, discovery: Discovery):
        self.scheduling = scheduling
        self.discovery = discovery
        self.generation = 0

    def methods(self) -> list[Method]:
        return [
            _method("GetSchedulingStatus", self.status, pb.GetSchedulingStatusRequest),
            _method("SetSchedulingPolicy", self.set_policy, pb.SetSchedulingPolicyRequest),
            _method("SetModelPlacement", self.set_placement, pb.SetModelPlacementRequest),
            _method("Repack", self.repack, pb.RepackRequest),
        ]

    # -- status -------------------------------------------------------------------------------

    def _policy(self) -> pb.SchedulingPolicy:
        config = self.scheduling.config
        settings = packing_settings(config)
        replicas = -1 if config.default_replicas == "all" else config.default_replicas
        return pb.SchedulingPolicy(
            rebalance_compute_seconds=config.rebalance_compute_seconds,
            first_rebalance_compute_seconds=config.first_rebalance_compute_seconds,
            hysteresis=config.hysteresis,
            ema_halflife_compute_seconds=settings.halflife_compute_seconds,
            default_replicas=replicas,
            routing_policy=config.routing_policy,
            routing_fill_mode=config.routing_fill_mode,
            routing_fill_factor=config.routing_fill_factor,
            routing_fill_hold_seconds=config.routing_fill_hold_seconds,
            compaction_mode=config.compaction_mode,
            compaction_interval=config.compaction_interval,
            forbid_memory_oversubscription=config.forbid_memory_oversubscription,
            work_basis=config.work_basis,
            generation=self.generation,
        )

    def _repack_status(self) -> pb.RepackStatus | None:
        planner = self.scheduling.planner
        if planner is None:
            return None
        clock = planner.clock.status()
        now_mono, now_unix = time.monotonic(), time.time()
        last = 0.0 if clock.last_repack_at is None else now_unix - (now_mono - clock.last_repack_at)
        return pb.RepackStatus(
            last_repack_unix_seconds=last,
            last_repack_wall_seconds=clock.last_repack_wall_elapsed_seconds,
            last_repack_compute_seconds=clock.last_repack_compute_seconds,
            last_trigger=clock.last_trigger.value if clock.last_trigger else "",
            last_models_placed=clock.last_models_placed,
            last_models_moved=clock.last_models_moved,
            repack_count=clock.repack_count,
            compute_accumulated_seconds=clock.compute_accumulated_seconds,
            threshold_seconds=clock.active_threshold_seconds,
            first_traffic_repack_done=clock.first_compute_repack_done,
            operator_repacks_requested=clock.operator_repacks_requested,
            operator_repacks_completed=clock.operator_repacks_completed,
        )

    async def status(self, request, call: ServerCall) -> pb.SchedulingStatus:
        s = self.scheduling
        planner = s.planner
        fill = s.router.settings if isinstance(s.router, FillRouter) else None
        models = model_views(
            ledger=s.ledger,
            meta=s.meta,
            routes=s.fleet.routes,
            result=planner.last if planner else None,
            rates=planner.rates if planner else None,
            fill=fill,
            policy=planner.settings.placement if planner else None,
            ready_workers=len(s.fleet.ready),
        )
        workers = worker_views(
            ledger=s.ledger,
            workers=[w.name for w in s.fleet.workers],
            ready=[w.name for w in s.fleet.ready],
            budgets=s.meta.budgets,
            result=planner.last if planner else None,
        )
        response = pb.SchedulingStatus(mode=s.mode, warnings=s.warnings)
        if s.mode != "round_robin":
            response.policy.CopyFrom(self._policy())
        if (repack := self._repack_status()) is not None:
            response.repack.CopyFrom(repack)
        for m in models:
            response.models.add(
                name=m.name,
                configured_replicas=m.configured_replicas,
                effective_replicas=m.effective_replicas,
                replicas=[
                    pb.ReplicaStatus(
                        worker=r.worker,
                        weight=r.weight,
                        outstanding=r.outstanding,
                        routed=r.routed_total,
                    )
                    for r in m.replicas
                ],
                utilization=m.utilization,
                arrival_rate=m.arrival_rate,
                cost_seconds=m.cost_seconds,
                max_batch=m.max_batch,
                fill_mode=m.fill_mode,
                fill_quantum=m.fill_quantum,
                weight_bytes=m.weight_bytes,
                placed=m.placed,
                drifted=m.drifted,
            )
        for w in workers:
            response.workers.add(
                worker=w.worker,
                ready=w.ready,
                models_placed=w.models_placed,
                inflight_load=w.inflight_compute,
                assigned_weight_bytes=w.assigned_weight_bytes,
                weight_budget_bytes=w.weight_budget_bytes,
                oversubscribed=w.oversubscribed,
            )
        return response

    # -- steering -----------------------------------------------------------------------------

    def _require_packing(self, rpc: str) -> None:
        if self.scheduling.planner is None:
            raise FailedPrecondition(
                f"{rpc} steers lpt_packing; this gateway schedules {self.scheduling.mode}"
            )

    def _apply(self, config: SchedulingConfig) -> list[str]:
        """Validate ``config`` whole, then apply it; returns the planner's warnings.
        Raises InvalidArgument (nothing applied) when a value is out of range."""
        try:
            config = msgspec.convert(msgspec.to_builtins(config), SchedulingConfig)
            settings, fill = packing_settings(config), fill_settings(config)
        except (msgspec.ValidationError, ConfigError, ValueError) as e:
            raise InvalidArgument(str(e)) from None
        s = self.scheduling
        assert s.planner is not None and s.holds is not None and isinstance(s.router, FillRouter)
        warnings = s.planner.configure(settings)
        s.tracker.halflife_compute_seconds = settings.halflife_compute_seconds
        s.router.settings = fill
        s.router.policy = config.routing_policy
        s.router.work_basis = config.work_basis
        s.holds.configure(config.routing_fill_hold_seconds)
        s.config = config
        return warnings

    async def set_policy(self, request, call: ServerCall) -> pb.SetSchedulingPolicyResponse:
        self._require_packing("SetSchedulingPolicy")
        if not request.update_mask:
            raise InvalidArgument("update_mask is empty: name the fields to change")
        if not request.HasField("policy"):
            raise InvalidArgument("policy is not set")
        changes = {}
        for name in request.update_mask:
            if name in _STARTUP_ONLY:
                raise InvalidArgument(f"{name} cannot be changed: {_STARTUP_ONLY[name]}")
            if name not in _POLICY_FIELDS:
                raise InvalidArgument(
                    f"unknown field {name!r}; fields: {', '.join(sorted(_POLICY_FIELDS))}"
                )
            value = getattr(request.policy, name)
            if isinstance(value, float) and not math.isfinite(value):  # (as in a file)
                raise InvalidArgument(f"{name} must be a finite number, not {value}")
            if name == "default_replicas":
                if value == -1:
                    value = "all"
                elif value < 1:
                    raise InvalidArgument("default_replicas must be >= 1, or -1 for all")
            changes[_POLICY_FIELDS[name]] = value
        config = msgspec.structs.replace(self.scheduling.config, **changes)
        warnings = self._apply(config)
        if "routing_fill_mode" in changes and changes["routing_fill_mode"] == "inflight":
            warnings.append(INFLIGHT_WARNING)
        self.generation += 1
        return pb.SetSchedulingPolicyResponse(applied=self._policy(), warnings=warnings)

    async def set_placement(self, request, call: ServerCall) -> pb.SetModelPlacementResponse:
        self._require_packing("SetModelPlacement")
        s = self.scheduling
        name = request.name
        if not name:
            raise InvalidArgument("name is empty")
        if request.HasField("replicas") and request.replicas < -1:
            raise InvalidArgument("replicas must be > 0, -1 (every worker) or 0 (the default)")
        if request.fill_mode not in ("", "inherit", "run", "spread", "inflight"):
            raise InvalidArgument(
                f"fill_mode {request.fill_mode!r}: expected run, spread, inflight or inherit"
            )
        if request.HasField("fill_factor") and not 0 <= request.fill_factor <= MAX_FILL_FACTOR:
            raise InvalidArgument(
                f"fill_factor must be > 0 and <= {MAX_FILL_FACTOR:g}, or 0 for the default"
            )
        if name not in s.fleet.routes and not request.allow_unknown_model:
            await self.discovery.changes_seen()  # (loaded through the gateway a moment ago)
            if name not in s.fleet.routes:
                await self.discovery.refresh()
        if name not in s.fleet.routes and not request.allow_unknown_model:
            raise NotFound(
                f"model {name!r} is not served by any ready worker "
                "(allow_unknown_model, or --allow-unknown on the command line, places it ahead "
                "of time)"
            )
        current = s.config.models.get(name, ModelPlacementConfig())  # (as it is now)
        replicas, mode, factor = current.replicas, current.fill_mode, current.fill_factor
        if request.HasField("replicas"):
            replicas = {0: None, -1: "all"}.get(request.replicas, request.replicas)
        if request.fill_mode:
            mode = None if request.fill_mode == "inherit" else request.fill_mode
        if request.HasField("fill_factor"):
            factor = request.fill_factor or None
        models = dict(s.config.models)
        models[name] = ModelPlacementConfig(replicas=replicas, fill_mode=mode, fill_factor=factor)
        warnings = self._apply(msgspec.structs.replace(s.config, models=models))
        self.generation += 1
        ready = len(s.fleet.ready)
        placement = s.planner.settings.placement
        configured = placement.configured(name)
        effective = placement.effective(name, ready)
        if configured != ALL_REPLICAS and configured > ready:
            warnings.append(
                f"{configured} replicas but {ready} ready worker(s): clamped to {ready}"
            )
        assert isinstance(s.router, FillRouter)
        plan = s.router.plan(name)
        if plan.mode.value == "inflight":
            warnings.append(INFLIGHT_WARNING)
        if request.HasField("replicas"):  # (the fill mode and factor apply at once)
            warnings.append("replicas take effect at the next repack (Repack runs one now)")
        return pb.SetModelPlacementResponse(
            name=name,
            configured_replicas=configured,
            effective_replicas=effective,
            fill_mode=plan.mode.value,
            fill_quantum=fill_quantum(
                factor or s.config.routing_fill_factor, s.meta.max_batch(name)
            ),
            warnings=warnings,
        )

    async def repack(self, request, call: ServerCall) -> pb.RepackResponse:
        self._require_packing("Repack")
        if math.isnan(request.wait_seconds) or request.wait_seconds < 0:
            raise InvalidArgument(  # (larger ones are clamped)
                f"wait_seconds must be a number >= 0, not {request.wait_seconds:g}"
            )
        wait = min(request.wait_seconds, MAX_WAIT_SECONDS)
        s = self.scheduling
        if wait > 0 and not s.fleet.ready:
            raise Unavailable("no worker is ready: a repack cannot run")
        sequence = s.request_repack()
        self.discovery.wake()
        clock = s.planner.clock
        start = trio.current_time()
        with trio.move_on_after(wait):
            while clock.operator_completed < sequence:
                await trio.sleep(0.02)
        completed = clock.operator_completed >= sequence
        warnings = list(s.warnings)
        if wait > 0 and not completed:
            warnings.append(f"not completed within {wait:g} s: it runs at a coming round")
        return pb.RepackResponse(
            sequence=sequence,
            completed_sequence=clock.operator_completed,
            completed=completed,
            waited_seconds=trio.current_time() - start,
            repack=self._repack_status(),
            warnings=warnings,
        )
