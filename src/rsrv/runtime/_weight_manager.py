"""The weight-transfer worker: the one trio task that moves weights onto the device.

Every host-to-device copy happens here, one at a time, in a worker thread. The dispatch
loop asks for a model's weights with :meth:`WeightManager.lease` (waiting only when they
are not resident); the scheduler calls :meth:`WeightManager.prefetch` for the model it
expects to run next, so that copy overlaps the current execution.

Residency floors (``scheduler.models.<name>.residency``):

* ``system``: staged in host RAM at load (the default while the cache is on), where the
  staging route keeps it (``pageable``, or ``pinned_host`` memory on the ``pinned``
  route); a device load is one host-to-device copy of the staged floor.
* ``unpinned``: nothing kept in RAM; a device load reads the weights file.
* ``device``: copied at load and kept on the device, outside the budget.

With the cache off (no budget) every model is copied at load and never evicted.

The budget itself comes from :func:`weight_budget`; the scratch it leaves room for is
measured around warm-up runs (:meth:`WeightManager.measure_scratch`) from the allocator's
statistics (``rsrv.runtime._allocator``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import jax
import trio

from rsrv.bundle import WeightsFile, file_identity
from rsrv.errors import FailedPrecondition, NotFound
from rsrv.runtime._allocator import AllocatorStats, measured_scratch
from rsrv.runtime._staging import HostWeights, Staging, free, place, stage, staging_route, to_device
from rsrv.runtime._weight_cache import Resident, WeightCache

log = logging.getLogger(__name__)


class FileReplaced(OSError):
    """The weights file at a version's path is no longer the one it loaded."""


@dataclass(eq=False, slots=True)
class Placement:
    file: WeightsFile | None
    residency: str
    host: HostWeights | None = None  # the staged floor of a "system" model
    fd: int | None = None  # an "unpinned" model's weights file, open since load
    identity: tuple[int, ...] | None = None  # of the file its header came from

    def open(self) -> None:
        """Hold the file open, so this version keeps reading its own weights even after
        the bundle is replaced on disk (a rename; in-place overwrites are not safe).
        Raises FileReplaced when the file at the path is no longer the one it loaded."""
        if self.fd is None and self.file is not None:
            self.fd = self._open_checked()

    def _open_checked(self) -> int:
        assert self.file is not None
        fd = os.open(self.file.path, os.O_RDONLY)
        if self.identity is not None and file_identity(os.fstat(fd)) != self.identity:
            os.close(fd)
            raise FileReplaced(f"{self.file.path} was replaced since it loaded")
        return fd

    def reader(self) -> int | None:
        """A descriptor of its own for one read in a worker thread, closed by whoever
        took it: a duplicate of the open file (a residency change closing the
        placement's file meanwhile cannot pull it from under the read: EBADF, or worse,
        another file opened on the number since); with none open, the file at the path,
        opened now and checked as :meth:`open` does (FileReplaced). None without a
        weights file."""
        if self.fd is not None:
            return os.dup(self.fd)
        return None if self.file is None else self._open_checked()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass(eq=False, slots=True)
class _Probe:
    """Allocator statistics read when the next lease of a key was granted."""

    at_lease: dict | None = None
    taken: bool = False


@dataclass(eq=False, slots=True)
class _Transfer:
    """One requested host-to-device copy; everyone waiting for it shares its outcome."""

    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None


class WeightManager:
    """Owns device weights for every model version, keyed by executable key."""

    def __init__(
        self,
        budget: int | None,
        device: jax.Device,
        compaction_interval: int = 0,
        *,
        resize: Callable[[int], int | None] | None = None,
        staging: Staging | None = None,
        allocator: AllocatorStats | None = None,
    ):
        """``resize(max_scratch)``, when given, re-derives the budget each time a larger
        scratch is measured (a budget derived from the device limit). ``staging`` is the
        route of ``system`` floors (None: :func:`staging_route` of ``device``);
        ``allocator`` the allocator statistics scratch is measured from (None: the
        device's own)."""
        self.cache = WeightCache(budget)
        self._resize = resize
        self.device = device
        self.staging = staging_route(device) if staging is None else staging
        self.allocator: AllocatorStats = device if allocator is None else allocator
        self._probes: dict[str, _Probe] = {}  # keys whose next lease reads the allocator
        self.compaction_interval = compaction_interval
        self.compactions = 0
        self._loads_at_compaction = 0
        self.max_scratch = 0  # bytes, largest measured at warm-up (0 where unreported)
        self.placements: dict[str, Placement] = {}
        self._limiter = trio.CapacityLimiter(1)  # one transfer at a time
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self._transfers: dict[str, _Transfer] = {}  # requested, not finished
        # demands (leases, loads) waiting per key: those keys are about to be used, so
        # they are never evicted, and a transfer of one is never skipped
        self._waiting: defaultdict[str, int] = defaultdict(int)
        self._expected: defaultdict[str, int] = defaultdict(int)  # see expected()

    # -- registration (model load / unload, off the dispatch loop) --------------------

    def residency_for(self, requested: str | None) -> str:
        if requested is not None:
            return requested
        return "system" if self.cache.enabled else "device"

    async def add(self, key: str, file: WeightsFile | None, residency: str) -> None:
        """Register a model version: stage its host floor, or place it now if pinned."""
        placement = Placement(file, residency)
        if file is not None:  # (a file renamed in since the header was read: FileReplaced)
            placement.identity = file.identity or None
        if file is not None and residency == "system":
            placement.host = await self._staged_floor(placement)
        elif residency == "unpinned":
            placement.open()
        self.placements[key] = placement
        if residency == "device" or not self.cache.enabled:
            await self._ensure(key)

    def remove(self, key: str) -> None:
        """Forget a retired version: free its device weights and host floor now."""
        self.cache.drop(key)
        placement = self.placements.pop(key, None)
        if placement is not None:
            placement.close()

    def nbytes(self, key: str) -> int:
        placement = self.placements.get(key)
        return placement.file.nbytes if placement and placement.file else 0

    # -- the dispatch path --------------------------------------------------------------

    @asynccontextmanager
    async def lease(self, key: str):
        """Yield the device weights of ``key``; they cannot be evicted until exit."""
        resident = await self._ensure(key)
        resident.leases += 1  # no checkpoint since _ensure found it resident
        probe = self._probes.get(key)
        if probe is not None and not probe.taken:  # a warm-up measuring its scratch
            probe.at_lease, probe.taken = self.allocator.memory_stats(), True
        try:
            yield resident.arrays
        finally:
            resident.leases -= 1

    async def prefetch(self, key: str) -> None:
        """Move ``key``'s weights to the device ahead of its lease, if they fit.

        Best effort: a prefetch never pushes resident bytes over the budget, so it is
        skipped when the room is held by leased or demanded models (the lease loads the
        weights later). Returns once the transfer is done or skipped.
        """
        if key not in self.placements or self.cache.get(key) is not None:
            return  # (get marks it most recently used: it is about to run)
        transfer = self._request(key)
        await transfer.done.wait()
        if transfer.error is not None:
            raise transfer.error

    async def _ensure(self, key: str) -> Resident:
        """``key``'s device weights, transferred first if needed. A demand: while it
        waits, ``key`` is protected from eviction and its transfer is never skipped."""
        with _counted(self._waiting, key):
            while True:
                resident = self.cache.get(key)
                if resident is not None:
                    return resident
                if key not in self.placements:
                    raise NotFound(f"model version {key!r} is not loaded")
                transfer = self._request(key)
                await transfer.done.wait()
                if transfer.error is not None:
                    raise transfer.error

    def expected(self, key: str) -> AbstractContextManager[None]:
        """``key`` will run once the device is free (a batch of it waits for the device
        lock): while the block runs, a prefetch does not evict it (a demand still may:
        a run waiting for the device holds no room, §3). Nothing is transferred."""
        return _counted(self._expected, key)

    def _protected_from(self, key: str) -> frozenset[str]:
        """What a transfer of ``key`` may not evict: the demanded models; for a
        prefetch, also those whose runs wait for the device."""
        if key in self._waiting or not self._expected:
            return frozenset(self._waiting)
        return frozenset(self._waiting).union(self._expected)

    def _prefetch_fits(self, key: str, nbytes: int, protected: frozenset[str]) -> bool:
        """Whether a prefetch of ``key`` fits beside the ``protected`` models, counting
        the room those not yet resident take once their own transfers come: a prefetch
        queued ahead of the demand of the model about to run must not take its room
        (it was copied, then evicted by that demand, and copied again at its own run)."""
        coming = sum(
            self.nbytes(k)
            for k in protected
            if k != key
            and k in self.placements
            and self.placements[k].residency != "device"
            and not self.cache.is_resident(k)
        )
        return self.cache.fits(nbytes + coming, protected)

    def _request(self, key: str) -> _Transfer:
        """The pending transfer of ``key``, queued for the transfer task if new."""
        transfer = self._transfers.get(key)
        if transfer is None:
            transfer = self._transfers[key] = _Transfer()
            self._send.send_nowait(key)
        return transfer

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The transfer task: serve transfer requests in arrival order, forever."""
        task_status.started()
        async for key in self._receive:
            transfer = self._transfers[key]
            try:
                await self._transfer(key)
            except Exception as e:  # (a replaced file: its waiter says so, a load retries)
                level = logging.WARNING if isinstance(e, FileReplaced) else logging.ERROR
                log.log(level, "weight transfer of %s failed: %s", key, e)
                transfer.error = e
            finally:
                del self._transfers[key]
                transfer.done.set()

    async def _transfer(self, key: str) -> None:
        placement = self.placements.get(key)
        if placement is None or self.cache.is_resident(key):
            return
        pinned = placement.residency == "device"
        nbytes = self.nbytes(key)
        if not pinned and self.cache.enabled:
            protected = self._protected_from(key)  # about to be used: never evict them
            if key not in self._waiting and not self._prefetch_fits(key, nbytes, protected):
                log.debug(
                    "prefetch of %s skipped: %d bytes do not fit beside the models in use",
                    key,
                    nbytes,
                )
                return
            self.cache.make_room(nbytes, protected)
        start = time.perf_counter()
        # (what the copy reads is taken here, on the loop: see Placement.reader)
        host = placement.host
        fd = placement.reader() if host is None else None
        try:
            arrays = await trio.to_thread.run_sync(
                self._copy, placement.file, host, fd, limiter=self._limiter
            )
        finally:
            if fd is not None:
                os.close(fd)
        seconds = time.perf_counter() - start
        if self.placements.get(key) is not placement:  # removed while it was copied
            free(arrays)
            return
        # Admitted as the version is now (a SetModelResidency while it was copied), and
        # within the budget as it is now: models unpinned or a budget shrunk meanwhile
        # (note_scratch) take room again, and a prefetch that no longer fits is dropped.
        pinned = placement.residency == "device"
        if not pinned and self.cache.enabled:
            protected = self._protected_from(key)
            if key not in self._waiting and not self._prefetch_fits(key, nbytes, protected):
                log.debug("prefetch of %s dropped: the room it had is taken", key)
                free(arrays)
                return
            self.cache.make_room(nbytes, protected)
        self.cache.admit(key, arrays, nbytes, seconds, pinned=pinned)
        log.debug("weights of %s on device: %d bytes in %.4f s", key, nbytes, seconds)

    def _copy(
        self, file: WeightsFile | None, host: HostWeights | None, fd: int | None
    ) -> list[jax.Array]:
        """The device copy of ``host`` (a staged floor), or of ``file`` read now through
        ``fd`` (unpinned)."""
        if file is None:
            return []
        return to_device(host or stage(file, fd), self.device)

    async def _staged_floor(self, placement: Placement) -> HostWeights:
        """A ``system`` floor for ``placement`` (which has a weights file): staged in a
        worker thread through a descriptor of its own (:meth:`Placement.reader`: the
        file it loaded, FileReplaced if the path holds another now), and placed where
        the route says."""
        assert placement.file is not None
        fd = placement.reader()
        try:
            return await trio.to_thread.run_sync(
                lambda: place(stage(placement.file, fd), self.staging, self.device)
            )
        finally:
            if fd is not None:
                os.close(fd)

    # -- control (CompactMemory, SetModelResidency) ---------------------------------------

    def compact(self) -> int:
        """Free every evictable device weight at once; returns how many models."""
        self.compactions += 1
        self._loads_at_compaction = self.cache.counters.loads
        return self.cache.clear()

    def after_execution(self) -> None:
        """Auto-compaction: every ``compaction_interval`` loads (0 = never), free all
        evictable weights at once so the device allocator can defragment."""
        loads = self.cache.counters.loads
        if (
            self.compaction_interval
            and loads - self._loads_at_compaction >= self.compaction_interval
        ):
            freed = self.compact()
            log.info(
                "auto-compaction after %d loads freed %d model(s)", self.compaction_interval, freed
            )

    @asynccontextmanager
    async def measure_scratch(self, key: str):
        """Around one execution of ``key`` (a warm-up run): read the allocator's
        statistics when the execution's lease is granted and again as soon as the block
        exits, and note the scratch they show (:func:`measured_scratch`; nothing where
        the backend reports no statistics or the block raised)."""
        probe = self._probes[key] = _Probe()
        try:
            yield
        finally:
            del self._probes[key]
        if probe.at_lease:
            scratch = measured_scratch(probe.at_lease, self.allocator.memory_stats())
            log.debug("warm-up of %s: scratch %s bytes", key, scratch)
            if scratch is not None:
                self.note_scratch(scratch)

    def note_scratch(self, nbytes: int) -> None:
        """Record device memory a model needed beyond its weights (measured at warm-up).
        A larger scratch shrinks a budget derived from the device limit right away, and
        idle models are evicted until the resident weights fit the new budget."""
        if nbytes <= self.max_scratch:
            return
        self.max_scratch = nbytes
        if self._resize is not None and self.cache.enabled:
            self.cache.budget = self._resize(nbytes)
            evicted = self.cache.trim(frozenset(self._waiting))
            log.info(
                "weight cache budget %s bytes (largest scratch %d bytes)%s",
                self.cache.budget,
                nbytes,
                f"; evicted {len(evicted)} model(s) to fit it" if evicted else "",
            )

    async def compact_and_reload(self, keys: list[str]) -> int:
        """CompactMemory: free every evictable weight, then load ``keys`` again, each as
        a prefetch is (never beside the models in use, or about to be, beyond the budget:
        one that does not fit is passed over); returns how many were copied onto the
        device (not those that stayed: pinned, executing, or listed twice). A key retired
        meanwhile (a reload replaced its version while the others were copied) is passed
        over too. Raises the error of a copy that failed."""
        self.compact()
        reloaded = 0
        for key in keys:
            if self.cache.is_resident(key):
                continue
            await self.prefetch(key)  # (a demand was loaded over the budget beside a run)
            reloaded += self.cache.is_resident(key)
        return reloaded

    async def set_residency(self, key: str, residency: str) -> None:
        """Change a version's floor now (SetModelResidency).

        ``device`` places the weights and pins them (the host copy is dropped);
        ``system`` stages a host copy and makes the device copy evictable;
        ``unpinned`` drops the host copy and makes the device copy evictable.
        The new source of the weights is made ready before the old one goes: a change
        that cannot be made (its weights file unreadable) raises FailedPrecondition and
        leaves the version as it was. NotFound when ``key`` is not loaded.
        """
        placement = self.placements.get(key)
        if placement is None:
            raise NotFound(f"model version {key!r} is not loaded")
        previous = placement.residency
        try:
            if residency == "system" and placement.host is None and placement.file is not None:
                placement.host = await self._staged_floor(placement)
            elif residency == "unpinned":
                placement.open()
            elif residency == "device":
                placement.residency = "device"  # (transferred as pinned: no room made)
                if not self.cache.pin(key) and key not in self.cache.pinned:
                    await self._ensure(key)  # from the source it has now
        except OSError as e:
            placement.residency = previous
            raise FailedPrecondition(
                f"model version {key!r} cannot be made {residency}: its weights file cannot "
                f"be read ({e.strerror or e}); it stays {previous}"
            ) from None
        except BaseException:
            placement.residency = previous
            raise
        if residency != "system":
            placement.host = None
        if residency != "unpinned":
            placement.close()
        placement.residency = residency
        if previous == "device" and residency != "device" and self.cache.enabled:
            self.cache.unpin(key)  # now under the budget: idle models give it room
            evicted = self.cache.trim(frozenset(self._waiting))
            if evicted:
                log.info("%s unpinned: evicted %d model(s) to fit it", key, len(evicted))

    def host_resident(self, key: str) -> bool:
        placement = self.placements.get(key)
        return placement is not None and placement.host is not None


def weight_budget(runtime, limit: int | None, max_scratch: int = 0) -> int | None:
    """The device byte budget for evictable weights, or None when the cache is off.

    ``weight_cache_bytes`` wins when set (specs/config.md). Otherwise
    ``weight_cache_fraction: 0`` turns the cache off, and the allocator's byte ``limit``
    (:func:`~rsrv.runtime._allocator.allocator_limit`) is used: ``fraction x limit``, but
    never more than ``(1 - wiggle) x limit`` minus the largest scratch a model needs,
    and never below 0. No limit (CPU reports none): no cache unless
    ``weight_cache_bytes`` is set.
    """
    if runtime.weight_cache_bytes is not None:
        return runtime.weight_cache_bytes
    if runtime.weight_cache_fraction == 0 or not limit:
        return None
    pool = min(
        runtime.weight_cache_fraction * limit,
        (1 - runtime.weight_cache_wiggle_fraction) * limit - max_scratch,
    )
    return max(0, int(pool))


@contextmanager
def _counted(counts: defaultdict[str, int], key: str) -> Iterator[None]:
    """``key`` counted once more in ``counts`` while the block runs."""
    counts[key] += 1
    try:
        yield
    finally:
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
