"""Build the example bundles in bundles/ (run with `just bundles`).

Deterministic: weights come from fixed seeds and modules are written without source
locations, so rerunning yields byte-identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rsrv.bundle.manifest import TensorSpec
from rsrv.export import Input, Output, export_jax

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE = {"source": "scripts/make_bundles.py", "jax_version": jax.__version__}


def _dense(rng: np.random.Generator, n_in: int, n_out: int) -> dict[str, np.ndarray]:
    scale = np.sqrt(2.0 / n_in)
    return {"w": (rng.standard_normal((n_in, n_out)) * scale).astype(np.float32),
            "b": (rng.standard_normal(n_out) * 0.1).astype(np.float32)}


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
    x = jax.lax.conv_general_dilated(x, p["conv"]["w"], (2, 2), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
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
    conv = {"w": (rng.standard_normal((3, 3, 3, 8)) * 0.5).astype(np.float32),
            "b": np.zeros(8, np.float32)}
    coral = {"w": (rng.standard_normal((16, 1)) * 0.1).astype(np.float32),
             "gain": np.full((1, 1), 12.0, np.float32),
             "bias": np.linspace(-1.0, -11.0, GRADES, dtype=np.float32)}
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


def main(out: Path) -> None:
    export_jax(
        classifier_forward, classifier_params(),
        inputs=[Input("x", np.float32, ("n", 256), letters="nf")],
        outputs=[Output("logits", letters="nk")],
        batch_sizes=[1, 4, 8], out_dir=out / "classifier",
        description="MLP classifier: 256 features -> 10 class logits",
        provenance=PROVENANCE,
    )
    export_jax(
        grader_forward, grader_params(),
        inputs=[Input("image", np.uint8, ("n", 32, 32, 3), letters="nhwc")],
        outputs=[Output("logits", letters="nk")],
        batch_sizes=[1, 4, 8], out_dir=out / "severity_grader",
        description="Ordinal severity grader: u8 RGB image -> grade 0..6 (CORAL)",
        client_outputs=[TensorSpec(name="grade", dtype="i64", shape="n")],
        model_py=GRADER_MODEL_PY,
        provenance=PROVENANCE,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bundles")
