"""The benchmark bundles, exported with :func:`rsrv.export.export_jax` into
results/bundles/ (cached: a set is rebuilt only when its recipe or jax changes).

* ``dense``: a compute-bound MLP, ``depth`` dense layers of ``width`` (ReLU), so that one
  batch of 32 rows costs far less than 32 batches of one row.
* ``zoo``: ``count`` MLPs of one shape with distinct weights (seeded), for the
  many-models figure; one module shape, so they compile once between them.
* ``tiny``: ``count`` small MLPs whose widths all differ, so every module is distinct and
  a cold start really compiles each one (the restart figure).
* ``blob``: a request of any size answered with as many bytes (``blob`` UINT8[n,k] in,
  ``out`` UINT8[n,k] back; model.py hooks, a trivial module between): the large-tensor
  figure's, where the wire and the codec are the work.
* ``scale``: ``count`` tiny MLPs (64 -> 32 -> 8, about 9 KiB of weights) of one shape
  with distinct weights, for the scale figure: one bundle is exported, the others are
  its modules and manifest with their own seeded weights file (what exporting each
  would give: the weights are arguments, not part of the module).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from common import RESULTS, ROOT

BUNDLES = RESULTS / "bundles"
SCALE_WIDTHS = [64, 32, 8]


def _mlp_forward(p, x):
    import jax

    for layer in p["layers"]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x


def _mlp_params(seed: int, widths: list[int]) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "layers": [
            {
                "w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
                "b": (rng.standard_normal(b) * 0.01).astype(np.float32),
            }
            for a, b in zip(widths[:-1], widths[1:], strict=False)
        ]
    }


def _export(out: Path, seed: int, widths: list[int], batch_sizes: list[int], description: str):
    from rsrv.export import Input, Output, export_jax

    export_jax(
        _mlp_forward,
        _mlp_params(seed, widths),
        inputs=[Input("x", np.float32, ("n", widths[0]))],
        outputs=[Output("y")],
        batch_sizes=batch_sizes,
        out_dir=out,
        description=description,
        provenance={"source": "benchmarks/bundles.py"},
    )


def _cached(name: str, recipe: dict, build) -> Path:
    """results/bundles/NAME, rebuilt when its recipe (or jax) differs from the stamp."""
    import jax

    recipe = {**recipe, "jax": jax.__version__, "format": 1}
    repo = BUNDLES / name
    stamp = repo / ".recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return repo
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    build(repo)
    stamp.write_text(json.dumps(recipe))
    return repo


def dense(
    name: str,
    width: int,
    depth: int,
    batch_sizes: list[int],
    copies: list[str] | None = None,
    seed: int = 10,
) -> Path:
    """A repository holding the dense model (one bundle per name in ``copies``, distinct
    weights each), compiled at ``batch_sizes``."""
    copies = copies or ["dense"]

    def build(repo: Path):
        for i, model in enumerate(copies):
            _export(
                repo / model,
                seed + i,
                [width] * (depth + 1),
                batch_sizes,
                f"benchmark: {depth} dense layers of {width}",
            )

    return _cached(
        name,
        {
            "kind": "dense",
            "width": width,
            "depth": depth,
            "batch_sizes": batch_sizes,
            "copies": copies,
            "seed": seed,
        },
        build,
    )


def zoo(count: int, width: int, depth: int, batch_sizes: list[int]) -> Path:
    def build(repo: Path):
        for i in range(count):
            _export(
                repo / f"zoo{i:02d}",
                100 + i,
                [width] * (depth + 1),
                batch_sizes,
                f"benchmark zoo model {i}",
            )

    return _cached(
        f"zoo{count}",
        {"kind": "zoo", "count": count, "width": width, "depth": depth, "batch_sizes": batch_sizes},
        build,
    )


def tiny(count: int) -> Path:
    def build(repo: Path):
        for i in range(count):
            w = 16 + i
            _export(repo / f"tiny{i:03d}", 1000 + i, [w, w, 8], [1, 4], f"benchmark tiny model {i}")

    return _cached(f"tiny{count}", {"kind": "tiny", "count": count}, build)


def scale(count: int) -> Path:
    def build(repo: Path):
        from safetensors import safe_open
        from safetensors.numpy import save_file

        template = repo / "scale0000"
        _export(template, 5000, SCALE_WIDTHS, [1, 4], "benchmark scale model")
        with safe_open(str(template / "weights.safetensors"), "np") as f:
            metadata = f.metadata()
            shapes = {k: f.get_tensor(k).shape for k in f.keys()}
        for i in range(1, count):
            bundle = repo / f"scale{i:04d}"
            bundle.mkdir()
            for file in template.iterdir():
                if file.name != "weights.safetensors":
                    shutil.copy2(file, bundle / file.name)
            rng = np.random.default_rng(5000 + i)
            tensors = {
                k: (rng.standard_normal(shape) * 0.1).astype(np.float32)
                for k, shape in shapes.items()
            }
            save_file(tensors, str(bundle / "weights.safetensors"), metadata=metadata)

    return _cached(
        f"scale{count}", {"kind": "scale", "count": count, "widths": SCALE_WIDTHS}, build
    )


_BLOB_PY = """
import numpy as np

import rsrv


@rsrv.preprocess(inputs=["blob"], outputs=["x"])
def size(blob):
    return np.full((blob.shape[0], 1), blob.shape[1], np.int32)


@rsrv.postprocess(inputs=["y"], outputs=["out"])
def answer(y):
    return np.ones((len(y), int(y.max())), np.uint8)
"""


def blob() -> Path:
    """A repository with the ``blob`` bundle (see the module docstring)."""

    def build(repo: Path) -> None:
        from rsrv.bundle import TensorSpec
        from rsrv.export import Input, Output, export_jax

        export_jax(
            lambda p, x: x * p["one"],
            {"one": np.int32(1)},
            inputs=[Input("x", np.int32, ("n", 1))],
            outputs=[Output("y")],
            batch_sizes=[1],
            client_inputs=[TensorSpec(name="blob", dtype="u8", shape="nk", dims={"k": -1})],
            client_outputs=[TensorSpec(name="out", dtype="u8", shape="nk", dims={"k": -1})],
            model_py=_BLOB_PY,
            out_dir=repo / "blob",
            description="a request of any size answered with as many bytes",
            provenance={"source": "benchmarks/bundles.py"},
            parity=False,
        )

    return _cached("blob", {"model_py": _BLOB_PY}, build)


def classifier() -> Path:
    """A repository with only the repo's example ``classifier`` bundle (copied)."""
    repo = BUNDLES / "classifier_only"
    src = ROOT / "bundles" / "classifier"
    dst = repo / "classifier"
    if dst.exists():
        shutil.rmtree(dst)
    repo.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)
    return repo


def weight_bytes(bundle: Path) -> int:
    return (bundle / "weights.safetensors").stat().st_size
