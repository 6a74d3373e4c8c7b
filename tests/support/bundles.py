"""Test bundles and model repositories, exported once per session and then copied.

* ``tiny``: y = x @ w + b, x f32[n,3] -> y f32[n,2], batch sizes 1 and 2, weights
  argument_order (by tree path) b, w. Compiles in milliseconds (the ``tiny_template``
  fixture).
* ``linear`` (:func:`export_linear`): the same function with weights drawn from a seed,
  batch sizes 1, 2, 4, optionally slow to run, to preprocess or to load; :func:`matches`
  tells which seed answered.
* :func:`make_repo` builds a repository of:

  * ``classifier``, ``severity_grader``: copies of the examples in bundles/.
  * ``simple``: Triton's standard example model. INPUT0, INPUT1 INT32[n,16] ->
    OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1; compiled sizes 1, 4, 8.
  * ``simple_string``: Triton's ``simple_string``: the same with BYTES tensors holding
    decimal integers; model.py parses them (preprocess) and formats the results
    (postprocess). A non-integer element makes the preprocess hook raise.
  * ``slow``: x FP32[n,4] -> y = 2x; its preprocess sleeps ``x[0, 0]`` seconds (at most
    10), so a test can hold requests in flight, and raises ``ValueError("boom: ...")``
    when ``x[0, 0]`` is negative. ``ACTIVE[0]`` in its model.py counts sleeping hooks.
  * ``unbatched``: x FP32[4] -> y FP32[3] = x W (no batch axis, one module).
  * ``image``: an image classifier as Triton's image client expects one: x FP32[n,3,8,8]
    with axis letters ``nchw`` -> scores FP32[n,4] = mean over h, w of x, times W
    (:data:`IMAGE_W`); compiled sizes 1, 4.
  * ``words``: text BYTES[n,?] -> counts INT32[n,1] (its non-empty elements per row) and
    oks BYTES[n,max count] (that many ``b"ok"``); hooks around y = x; sizes 1, 2.
  * ``broken``: the classifier with an unsupported ``format_version``: UNAVAILABLE.

:func:`write_weights` writes a weights file (any tensors, any argument order).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from safetensors.numpy import save_file

from rsrv.bundle._safetensors import ORDER_KEY
from support import BUNDLES
from support.clients import infer_input

EXAMPLES = ("classifier", "severity_grader", "region_scorer", "patch_classifier", "region_pipeline")
GENERATED = ("simple", "simple_string", "slow", "unbatched", "image", "words")

SIMPLE_STRING_MODEL_PY = '''\
"""simple_string: BYTES decimal integers in and out around an INT32 add/subtract."""

import numpy as np

import rsrv


@rsrv.preprocess(inputs=["INPUT0", "INPUT1"], outputs=["a", "b"])
def parse(input0, input1):
    def ints(t):
        return np.array([int(v) for v in t.reshape(-1)], np.int32).reshape(t.shape)
    return ints(input0), ints(input1)


@rsrv.postprocess(inputs=["sum", "diff"], outputs=["OUTPUT0", "OUTPUT1"])
def format_results(total, diff):
    def text(t):
        out = np.empty(t.size, dtype=object)
        out[:] = [str(int(v)).encode() for v in t.reshape(-1)]
        return out.reshape(t.shape)
    return text(total), text(diff)
'''

WORDS_MODEL_PY = '''\
"""words: BYTES rows of any length in, their count of non-empty elements out, and that
many b"ok" per row back (a large BYTES request and answer from a tiny executable)."""

import numpy as np

import rsrv


@rsrv.preprocess(inputs=["text"], outputs=["x"])
def count(text):
    return np.array([[sum(1 for v in row if v)] for row in text], np.int32)


@rsrv.postprocess(inputs=["y"], outputs=["counts", "oks"])
def answer(y):
    oks = np.empty((len(y), int(y.max())), dtype=object)
    oks[:] = b"ok"
    return y, oks
'''

SLOW_MODEL_PY = '''\
"""slow: the preprocess hook sleeps x[0, 0] seconds (at most 10) to hold a request."""

import threading
import time

import rsrv

ACTIVE = [0]  # hooks sleeping right now (the tests poll it)
_LOCK = threading.Lock()


@rsrv.preprocess(inputs=["x"], outputs=["x"])
def hold(x):
    seconds = float(x.reshape(-1)[0])
    if seconds < 0:
        raise ValueError(f"boom: asked to hold for {seconds:g} seconds")
    with _LOCK:
        ACTIVE[0] += 1
    try:
        time.sleep(min(seconds, 10.0))
    finally:
        with _LOCK:
            ACTIVE[0] -= 1
    return x
'''


def _export(**kwargs) -> Path:
    from rsrv.export import export_jax

    return export_jax(provenance={"source": "tests/support/bundles.py"}, parity=False, **kwargs)


def _build_simple(out: Path) -> None:
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, a, b: (a + b, a - b),
        params={},
        inputs=[Input("INPUT0", np.int32, ("n", 16)), Input("INPUT1", np.int32, ("n", 16))],
        outputs=[Output("OUTPUT0"), Output("OUTPUT1")],
        batch_sizes=[1, 4, 8],
        out_dir=out,
        description="Triton's simple: sum and difference of two INT32[16]",
    )


def _build_simple_string(out: Path) -> None:
    from rsrv.bundle._manifest import TensorSpec
    from rsrv.export import Input, Output

    def spec(name):
        return TensorSpec(name=name, dtype="bytes", shape="nk", dims={"k": 16})

    _export(
        fn=lambda p, a, b: (a + b, a - b),
        params={},
        inputs=[Input("a", np.int32, ("n", 16)), Input("b", np.int32, ("n", 16))],
        outputs=[Output("sum"), Output("diff")],
        batch_sizes=[1, 4],
        client_inputs=[spec("INPUT0"), spec("INPUT1")],
        client_outputs=[spec("OUTPUT0"), spec("OUTPUT1")],
        model_py=SIMPLE_STRING_MODEL_PY,
        out_dir=out,
        description="Triton's simple_string: BYTES decimal integers",
    )


def _build_words(out: Path) -> None:
    from rsrv.bundle._manifest import TensorSpec
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, x: x * p["one"],
        params={"one": np.int32(1)},
        inputs=[Input("x", np.int32, ("n", 1))],
        outputs=[Output("y")],
        batch_sizes=[1, 2],
        client_inputs=[TensorSpec(name="text", dtype="bytes", shape="nk", dims={"k": -1})],
        client_outputs=[
            TensorSpec(name="counts", dtype="i32", shape="nk", dims={"k": 1}),
            TensorSpec(name="oks", dtype="bytes", shape="nk", dims={"k": -1}),
        ],
        model_py=WORDS_MODEL_PY,
        out_dir=out,
        description="counts the non-empty BYTES elements of each row",
    )


def _build_slow(out: Path) -> None:
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, x: x * p["scale"],
        params={"scale": np.float32(2.0)},
        inputs=[Input("x", np.float32, ("n", 4))],
        outputs=[Output("y")],
        batch_sizes=[1, 4],
        model_py=SLOW_MODEL_PY,
        out_dir=out,
        description="y = 2x after a preprocess that sleeps x[0, 0] seconds",
    )


UNBATCHED_W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10


def _build_unbatched(out: Path) -> None:
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, x: x @ p["w"],
        params={"w": UNBATCHED_W},
        inputs=[Input("x", np.float32, (4,))],
        outputs=[Output("y")],
        batch_sizes=[],
        out_dir=out,
        description="y = x W without a batch axis",
    )


IMAGE_W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10


def _build_image(out: Path) -> None:
    from rsrv.export import Input, Output

    _export(
        fn=lambda p, x: x.mean(axis=(2, 3)) @ p["w"],
        params={"w": IMAGE_W},
        inputs=[Input("x", np.float32, ("n", 3, 8, 8), letters="nchw")],
        outputs=[Output("scores", letters="nk")],
        batch_sizes=[1, 4],
        out_dir=out,
        description="scores of the channel means of an NCHW image",
    )


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "simple": _build_simple,
    "simple_string": _build_simple_string,
    "slow": _build_slow,
    "unbatched": _build_unbatched,
    "image": _build_image,
    "words": _build_words,
}


# -- the template cache ------------------------------------------------------------------------


@functools.cache
def _scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="rsrv-test-bundles-"))
    atexit.register(shutil.rmtree, path, True)
    return path


_lock = threading.Lock()


def _built(key: str, build: Callable[[Path], object]) -> Path:
    """The session's one built copy of the bundle ``key``: ``build(out)`` on first use."""
    out = _scratch() / "templates" / key
    with _lock:
        if not out.is_dir():
            build(out)
    return out


def template(name: str) -> Path:
    """The session's built copy of test bundle ``name`` (built on first use)."""
    return _built(name, _BUILDERS[name])


def make_repo(root: Path, *names: str) -> Path:
    """A model repository at ``root`` holding copies of the named bundles."""
    root.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__")
    for name in names:
        if name in EXAMPLES:
            shutil.copytree(BUNDLES / name, root / name, ignore=ignore)
        elif name == "broken":
            shutil.copytree(BUNDLES / "classifier", root / name, ignore=ignore)
            manifest = root / name / "manifest.yaml"
            text = manifest.read_text()
            assert "format_version: '2.0'" in text
            manifest.write_text(text.replace("format_version: '2.0'", "format_version: '9.9'"))
        else:
            shutil.copytree(template(name), root / name, ignore=ignore)
    return root


# -- tiny and linear -------------------------------------------------------------------------

#: A pass-through preprocess hook that sleeps, so requests spend time in flight before
#: they queue; the module itself may take a while to import (a slow load), or wait at an
#: :class:`ImportGate`.
SLOW_HOOK_PY = """
import os
import time

import rsrv

time.sleep({import_seconds})
_gate = os.environ.get("RSRV_TEST_IMPORT_GATE", "") if {import_gate} else ""
_until = time.monotonic() + 60
while _gate and os.path.exists(_gate) and time.monotonic() < _until:
    time.sleep(0.01)


@rsrv.preprocess(inputs=["x"], outputs=["x"])
def slow(x):
    time.sleep({seconds})
    return x
"""

#: Input rows of the tiny and linear bundles, and their weight bytes (w f32[3,2] + b f32[2]).
X = np.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]], np.float32)
WEIGHT_BYTES = 32


def linear_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((3, 2)).astype(np.float32),
        "b": rng.standard_normal(2).astype(np.float32),
    }


@dataclass(frozen=True)
class Linear:
    """One variant of the linear bundle: see :func:`export_linear`."""

    seed: int
    work: int = 0
    hook_seconds: float = 0.0
    import_seconds: float = 0.0
    import_gate: bool = False
    batch_sizes: tuple[int, ...] = (1, 2, 4)

    def export(self, out_dir: Path) -> Path:
        import jax
        import jax.numpy as jnp

        from rsrv.export import Input, Output, export_jax

        params = linear_params(self.seed)
        work = self.work
        if work:
            params["m"] = (
                np.random.default_rng(1000 + self.seed).standard_normal((192, 192)) * 0.01
            ).astype(np.float32)

        def fn(p, x):
            y = x @ p["w"] + p["b"]
            if work:
                h = jnp.tile(x, (1, 64))
                h = jax.lax.fori_loop(0, work, lambda i, h: jnp.tanh(h @ p["m"]), h)
                y = y + 0.0 * h.sum(axis=1, keepdims=True)  # per row: rows stay independent
            return y

        model_py = None
        if self.hook_seconds or self.import_seconds or self.import_gate:
            model_py = SLOW_HOOK_PY.format(
                seconds=self.hook_seconds,
                import_seconds=self.import_seconds,
                import_gate=self.import_gate,
            )
        return export_jax(
            fn,
            params,
            inputs=[Input("x", np.float32, ("n", 3), letters="nf")],
            outputs=[Output("y", letters="nk")],
            batch_sizes=list(self.batch_sizes),
            out_dir=out_dir,
            model_py=model_py,
        )


def tiny() -> Path:
    """The session's tiny bundle (seed 0, batch sizes 1 and 2)."""
    return _built("tiny", Linear(0, batch_sizes=(1, 2)).export)


def export_linear(out_dir: Path, seed: int, **variant) -> Path:
    """y = x @ w + b with x f32[n,3] -> y f32[n,2]; weights drawn from ``seed``.

    ``work`` > 0 adds that many iterations of a 192x192 matmul per row whose result is
    multiplied by zero: the answer is unchanged but each execution takes a while, so
    requests pile up in the scheduler queue. ``hook_seconds`` adds a model.py preprocess
    hook sleeping that long per request, ``import_seconds`` a model.py that sleeps that
    long when the bundle loads, ``import_gate`` one whose load waits at the
    :class:`ImportGate` closed when it loads; ``batch_sizes`` are (1, 2, 4) unless given.

    Each variant is exported once per session; ``out_dir`` receives a fresh copy (new
    mtimes), replacing any previous bundle there as a whole, as ``export_jax`` does.
    """
    linear = Linear(seed, **variant)
    source = _built("linear-" + "-".join(map(str, astuple(linear))), linear.export)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    shutil.rmtree(staging)
    shutil.copytree(source, staging, copy_function=shutil.copy)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return out_dir


class ImportGate:
    """Holds the loads of bundles exported with ``import_gate=True`` (their model.py's
    import waits, 60 s at most) from now until :meth:`open`, so that a test sees them
    LOADING for as long as it needs, however slow the machine: no fixed sleep to race.
    For workers in this process (the gate is a file named in its environment); export
    the bundle before closing the gate (an export imports its model.py too)."""

    def __init__(self, monkeypatch, path: Path):
        self.path = path
        path.touch()
        monkeypatch.setenv("RSRV_TEST_IMPORT_GATE", str(path))

    def open(self) -> None:
        self.path.unlink(missing_ok=True)


def expected(seed: int, x: np.ndarray) -> np.ndarray:
    """What the bundle exported with ``seed`` answers for ``x`` (rows, 3)."""
    p = linear_params(seed)
    return x.astype(np.float64) @ p["w"] + p["b"]


def matches(y: np.ndarray, seed: int, x: np.ndarray) -> bool:
    return y.shape == (len(x), 2) and np.allclose(y, expected(seed, x), rtol=1e-5, atol=1e-5)


def x_input(x: np.ndarray) -> grpcclient.InferInput:
    """Input ``x`` (FP32) of the tiny and linear bundles, and of any model named so."""
    return infer_input("x", np.ascontiguousarray(x, np.float32))


def infer_y(client: grpcclient.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    """Output ``y`` of ``model`` for input ``x``."""
    return client.infer(model, [x_input(x)]).as_numpy("y")


# -- weights files -----------------------------------------------------------------------------


def write_weights(
    path: Path,
    tensors: dict[str, np.ndarray],
    order: list[str] | None = None,
    *,
    metadata: bool = True,
    in_place: bool = False,
) -> Path:
    """Write ``tensors`` as the safetensors file ``path`` with ``order`` (default: the
    tensors' own order) as its argument_order, or with no metadata when not ``metadata``.

    The file is replaced atomically (a reader sees the old or the new one), or written
    ``in_place`` over the same inode (what a loaded version that holds the file sees).
    Returns ``path``."""
    header = {ORDER_KEY: json.dumps(list(tensors) if order is None else order)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=header if metadata else None)
    if in_place:
        with open(path, "r+b") as f:
            f.write(tmp.read_bytes())
        tmp.unlink()
    else:
        os.replace(tmp, path)
    return path
