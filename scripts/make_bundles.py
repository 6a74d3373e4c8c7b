"""Build the example bundles in bundles/ (run with `just bundles`).

Deterministic: weights come from fixed seeds and modules are written without source
locations, so rerunning yields byte-identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import msgspec
import numpy as np

from rsrv.bundle._manifest import TensorSpec
from rsrv.export import Input, Output, export_jax

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE = {"source": "scripts/make_bundles.py", "jax_version": jax.__version__}


def _dense(rng: np.random.Generator, n_in: int, n_out: int) -> dict[str, np.ndarray]:
    scale = np.sqrt(2.0 / n_in)
    return {
        "w": (rng.standard_normal((n_in, n_out)) * scale).astype(np.float32),
        "b": (rng.standard_normal(n_out) * 0.1).astype(np.float32),
    }


# -- classifier: a plain MLP, 256 features -> 10 logits, compiled at batch 1, 4 and 8 ------


def classifier_forward(p, x):
    h = jax.nn.relu(x @ p["hidden"]["w"] + p["hidden"]["b"])
    return h @ p["out"]["w"] + p["out"]["b"]


def classifier_params() -> dict:
    rng = np.random.default_rng(1)
    return {"hidden": _dense(rng, 256, 64), "out": _dense(rng, 64, 10)}


# -- severity_grader: u8 images -> CORAL ordinal logits; model.py turns them into a grade --

GRADES = 6  # CORAL emits GRADES logits, one per threshold "grade > k"


def grader_forward(p, image):
    x = image.astype(jnp.float32) / 255.0
    x = jax.lax.conv_general_dilated(
        x, p["conv"]["w"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    x = jax.nn.relu(x + p["conv"]["b"])
    x = x.mean(axis=(1, 2))
    h = jax.nn.relu(x @ p["hidden"]["w"] + p["hidden"]["b"])
    # CORAL: one shared score per image (here dominated by brightness, so the example
    # grades are easy to reason about), one ordered bias per threshold.
    brightness = image.astype(jnp.float32).mean(axis=(1, 2, 3))[:, None] / 255.0
    score = h @ p["coral"]["w"] + p["coral"]["gain"] * brightness
    return score + p["coral"]["bias"]


def grader_params() -> dict:
    rng = np.random.default_rng(2)
    conv = {
        "w": (rng.standard_normal((3, 3, 3, 8)) * 0.5).astype(np.float32),
        "b": np.zeros(8, np.float32),
    }
    coral = {
        "w": (rng.standard_normal((16, 1)) * 0.1).astype(np.float32),
        "gain": np.full((1, 1), 12.0, np.float32),
        "bias": np.linspace(-1.0, -11.0, GRADES, dtype=np.float32),
    }
    return {"conv": conv, "hidden": _dense(rng, 8, 16), "coral": coral}


GRADER_MODEL_PY = '''\
"""Turn CORAL ordinal logits into a severity grade.

The grade is the number of leading thresholds whose logit is positive; counting stops at
the first one that is not. The early break is a plain Python loop next to the model.
"""

import numpy as np

import rsrv


@rsrv.postprocess(inputs=["logits"], outputs=["grade"])
def grade(logits: np.ndarray) -> np.ndarray:
    out = np.zeros(logits.shape[0], np.int64)
    for row, values in enumerate(logits):
        count = 0
        for value in values:
            if value <= 0.0:
                break
            count += 1
        out[row] = count
    return out
'''


# -- region_pipeline: a meta model chaining two models with data-dependent Python -------

PATCH, GRID = 16, 4  # a 64x64 image is a 4x4 grid of 16x16 regions


def patches_of(image):
    """(n, 64, 64) -> (n, 16, 16, 16): the 16 regions of each image, row by row."""
    n = image.shape[0]
    return (
        image.reshape(n, GRID, PATCH, GRID, PATCH)
        .transpose(0, 1, 3, 2, 4)
        .reshape(n, GRID * GRID, PATCH, PATCH)
    )


def scorer_forward(p, image):
    regions = patches_of(image).reshape(image.shape[0], GRID * GRID, PATCH * PATCH)
    return regions @ p["w"] + p["b"]


def scorer_params() -> dict:
    rng = np.random.default_rng(3)
    # A region scores above 0 when it is brighter than ~0.5 on average.
    w = (4.0 / PATCH**2 + rng.standard_normal(PATCH * PATCH) * 1e-3).astype(np.float32)
    return {"w": w, "b": np.float32(-2.0)}


def patch_classifier_forward(p, crop):
    h = jax.nn.relu(crop.reshape(crop.shape[0], -1) @ p["hidden"]["w"] + p["hidden"]["b"])
    return h @ p["out"]["w"] + p["out"]["b"]


def patch_classifier_params() -> dict:
    rng = np.random.default_rng(4)
    return {"hidden": _dense(rng, PATCH * PATCH, 32), "out": _dense(rng, 32, 5)}


PIPELINE_MANIFEST = {
    "format_version": "2.0",
    "kind": "meta",
    "description": "Scores the 16 regions of a 64x64 image, keeps the top 4 scoring above 0 "
    "and classifies each (returns nothing when no region qualifies)",
    "client_inputs": [{"name": "image", "dtype": "f32", "shape": "hw", "dims": {"h": 64, "w": 64}}],
    "client_outputs": [
        {"name": "regions", "dtype": "i64", "shape": "k", "dims": {"k": -1}},
        {"name": "scores", "dtype": "f32", "shape": "k", "dims": {"k": -1}},
        {"name": "labels", "dtype": "i64", "shape": "k", "dims": {"k": -1}},
    ],
    "meta": {"calls": ["region_scorer", "patch_classifier"]},
    "provenance": PROVENANCE,
}

PIPELINE_MODEL_PY = '''\
"""Two stages with data-dependent Python in between.

region_scorer scores the 16 regions of the image; the glue keeps the TOP_K best regions
scoring above THRESHOLD (and stops early when there are none); patch_classifier labels
the crops of the kept regions.
"""

import numpy as np

import rsrv

PATCH, GRID, TOP_K, THRESHOLD = 16, 4, 4, 0.0


@rsrv.meta(inputs=["image"], outputs=["regions", "scores", "labels"])
def pipeline(call, image):
    scores = call("region_scorer", {"image": image[None]})["scores"][0]
    keep = np.flatnonzero(scores > THRESHOLD)
    if keep.size == 0:  # early exit: nothing worth classifying
        return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)
    keep = keep[np.argsort(-scores[keep], kind="stable")][:TOP_K]
    rows, cols = np.divmod(keep, GRID)
    crops = np.stack([image[r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH]
                      for r, c in zip(rows, cols)])
    logits = call("patch_classifier", {"crop": crops})["logits"]
    return keep.astype(np.int64), scores[keep], logits.argmax(axis=1).astype(np.int64)
'''


def write_meta_bundle(out_dir: Path, manifest: dict, model_py: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.iterdir():
        stale.unlink()
    (out_dir / "manifest.yaml").write_bytes(msgspec.yaml.encode(manifest))
    (out_dir / "model.py").write_text(model_py)


def main(out: Path) -> None:
    export_jax(
        classifier_forward,
        classifier_params(),
        inputs=[Input("x", np.float32, ("n", 256), letters="nf")],
        outputs=[Output("logits", letters="nk")],
        batch_sizes=[1, 4, 8],
        out_dir=out / "classifier",
        description="MLP classifier: 256 features -> 10 class logits",
        provenance=PROVENANCE,
    )
    export_jax(
        grader_forward,
        grader_params(),
        inputs=[Input("image", np.uint8, ("n", 32, 32, 3), letters="nhwc")],
        outputs=[Output("logits", letters="nk")],
        batch_sizes=[1, 4, 8],
        out_dir=out / "severity_grader",
        description="Ordinal severity grader: u8 RGB image -> grade 0..6 (CORAL)",
        client_outputs=[TensorSpec(name="grade", dtype="i64", shape="n")],
        model_py=GRADER_MODEL_PY,
        provenance=PROVENANCE,
    )
    export_jax(
        scorer_forward,
        scorer_params(),
        inputs=[Input("image", np.float32, ("n", 64, 64), letters="nhw")],
        outputs=[Output("scores", letters="nr")],
        batch_sizes=[1, 4],
        out_dir=out / "region_scorer",
        description="Stage 1 of region_pipeline: one score per 16x16 region of a 64x64 image",
        provenance=PROVENANCE,
    )
    export_jax(
        patch_classifier_forward,
        patch_classifier_params(),
        inputs=[Input("crop", np.float32, ("n", PATCH, PATCH), letters="nhw")],
        outputs=[Output("logits", letters="nk")],
        batch_sizes=[1, 4],
        out_dir=out / "patch_classifier",
        description="Stage 2 of region_pipeline: 16x16 crop -> 5 class logits",
        provenance=PROVENANCE,
    )
    write_meta_bundle(out / "region_pipeline", PIPELINE_MANIFEST, PIPELINE_MODEL_PY)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bundles")
