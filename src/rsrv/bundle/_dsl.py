"""The bundle DSL: decorators a bundle's ``model.py`` uses to declare its Python hooks.

A hook binds tensors by name. It is called with one numpy array per name in ``inputs``
(in that order) and returns the arrays named in ``outputs``: a single array when there is
one output, otherwise a tuple/list in ``outputs`` order or a dict keyed by name::

    import numpy as np

    import rsrv

    @rsrv.postprocess(inputs=["logits"], outputs=["grade"])
    def grade(logits: np.ndarray) -> np.ndarray:
        ...

Hooks see one request at a time (all its rows) and run in worker threads, concurrently
across requests, never on the dispatch loop: they must be thread-safe. A meta hook
(``@rsrv.meta``) additionally receives ``call(model, {name: array}) -> {name: array}`` as
its first argument to run declared sub-models.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import trio

from rsrv.errors import Internal, RsrvError

HookKind = Literal["preprocess", "postprocess", "meta"]


@dataclass(frozen=True, slots=True)
class Hook:
    """A declared hook. Calling it calls the wrapped function unchanged."""

    kind: HookKind
    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def apply(self, tensors: Mapping[str, np.ndarray], *leading: Any) -> dict[str, np.ndarray]:
        """Call the hook on ``tensors`` (by name) and return its outputs by name.

        ``leading`` arguments (the meta ``call``) are passed before the tensors.
        Raises ``TypeError``/``ValueError`` naming the hook when it returns the wrong thing.
        """
        result = self.fn(*leading, *(tensors[name] for name in self.inputs))
        return _bind_outputs(self, result)

    def run(self, model: str, tensors: Mapping[str, np.ndarray], *leading: Any):
        """:meth:`apply` as the server calls it: a failure of the user's code (an
        exception, or ``KeyboardInterrupt`` / ``SystemExit`` raised in it) becomes the
        model's ``Internal`` error naming the hook (rsrv's own errors pass through)."""
        try:
            return self.apply(tensors, *leading)
        except (RsrvError, trio.Cancelled):  # (a meta call's Cancelled: the trio side's)
            raise
        # (user code: whatever it raises, KeyboardInterrupt, SystemExit or a class of its
        # own deriving from BaseException included, fails the request, never the worker)
        except BaseException as e:
            raise Internal(
                f"model {model!r}: {self.kind} hook {self.name!r} failed: {type(e).__name__}: {e}"
            ) from None

    @property
    def name(self) -> str:
        """The hook's name in messages (a callable object's: its class name)."""
        return getattr(self.fn, "__name__", type(self.fn).__name__)


def _declare(kind: HookKind, inputs: Sequence[str], outputs: Sequence[str]):
    for arg, names in (("inputs", inputs), ("outputs", outputs)):
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"@rsrv.{kind}({arg}=...) takes a list of tensor names")
        if len(set(names)) != len(names):
            raise ValueError(f"@rsrv.{kind}({arg}=...) lists a tensor twice")
    if not outputs:
        raise ValueError(f"@rsrv.{kind} must declare at least one output")

    def decorate(fn: Callable[..., Any]) -> Hook:
        if not callable(fn):
            raise TypeError(f"@rsrv.{kind} decorates a function")
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"@rsrv.{kind} decorates a plain function, not async def {fn.__name__!r} "
                "(hooks run in a worker thread; a meta's call() blocks there)"
            )
        return Hook(kind, fn, tuple(inputs), tuple(outputs))

    return decorate


def preprocess(*, inputs: Sequence[str], outputs: Sequence[str]):
    """Declare the hook that turns client inputs into executable inputs."""
    return _declare("preprocess", inputs, outputs)


def postprocess(*, inputs: Sequence[str], outputs: Sequence[str]):
    """Declare the hook that turns executable outputs into client outputs."""
    return _declare("postprocess", inputs, outputs)


def meta(*, inputs: Sequence[str], outputs: Sequence[str]):
    """Declare a meta model's orchestration: ``fn(call, *inputs) -> outputs``."""
    return _declare("meta", inputs, outputs)


def _bind_outputs(hook: Hook, result: Any) -> dict[str, np.ndarray]:
    names = hook.outputs
    where = f"{hook.kind} hook {hook.name!r}"
    if isinstance(result, Mapping):
        if set(result) != set(names):
            raise ValueError(f"{where} returned tensors {sorted(result)}, declared {list(names)}")
        values = [result[n] for n in names]
    elif len(names) == 1 and not isinstance(result, (tuple, list)):
        values = [result]
    elif isinstance(result, (tuple, list)) and len(result) == len(names):
        values = list(result)
    else:
        raise ValueError(f"{where} must return {len(names)} array(s) {list(names)}")
    out = {}
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, np.ndarray):
            if value is None:
                raise TypeError(f"{where} returned None for {name!r}")
            value = np.asarray(value)
        out[name] = value
    return out
