"""The example bundles in bundles/: they run at every compiled batch size and match a numpy
reference computed independently from their weights files, the grader's model.py grades as
CORAL prescribes, and scripts/make_bundles.py reproduces them byte for byte.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from rsrv.bundle import Bundle, load_bundle, scan
from rsrv.runtime import Compiler, compile_bundle, weights_to_device

# -- numpy references (float64), written from the weights alone -----------------------------


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0)


def classifier_reference(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """relu(x W1 + b1) W2 + b2."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h = relu(x.astype(np.float64) @ w["hidden.w"] + w["hidden.b"])
    return h @ w["out.w"] + w["out.b"]


def conv2d_same(x: np.ndarray, kernel: np.ndarray, stride: int) -> np.ndarray:
    """NHWC x HWIO convolution with XLA's SAME padding (extra padding goes high)."""
    n, h, wd, _ = x.shape
    kh, kw, _, out_c = kernel.shape
    oh, ow = -(-h // stride), -(-wd // stride)
    ph = max((oh - 1) * stride + kh - h, 0)
    pw = max((ow - 1) * stride + kw - wd, 0)
    xp = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    out = np.zeros((n, oh, ow, out_c))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, i : i + stride * oh : stride, j : j + stride * ow : stride, :]
            out += np.einsum("nhwc,co->nhwo", patch, kernel[i, j])
    return out


def grader_reference(w: dict[str, np.ndarray], image: np.ndarray) -> np.ndarray:
    """conv 3x3/2 + relu, global mean, dense + relu, CORAL head (shared score + brightness
    gain, one bias per threshold)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    x = image.astype(np.float64) / 255.0
    x = relu(conv2d_same(x, w["conv.w"], 2) + w["conv.b"]).mean(axis=(1, 2))
    h = relu(x @ w["hidden.w"] + w["hidden.b"])
    brightness = image.astype(np.float64).mean(axis=(1, 2, 3))[:, None] / 255.0
    score = h @ w["coral.w"] + w["coral.gain"] * brightness
    return score + w["coral.bias"]


def coral_grade(logits: np.ndarray) -> np.ndarray:
    """Count the leading positive logits of each row (stop at the first non-positive)."""
    return np.cumprod(logits > 0, axis=-1).sum(axis=-1).astype(np.int64)


def classifier_inputs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, 256)).astype(np.float32)


def grader_inputs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


def regions_of(image: np.ndarray) -> np.ndarray:
    """(n, 64, 64) -> (n, 16, 256): the 4x4 grid of 16x16 regions, row by row, flattened."""
    n = image.shape[0]
    return image.reshape(n, 4, 16, 4, 16).transpose(0, 1, 3, 2, 4).reshape(n, 16, 256)


def scorer_reference(w: dict[str, np.ndarray], image: np.ndarray) -> np.ndarray:
    return regions_of(image.astype(np.float64)) @ w["w"].astype(np.float64) + float(w["b"])


def patch_classifier_reference(w: dict[str, np.ndarray], crop: np.ndarray) -> np.ndarray:
    return classifier_reference(w, crop.reshape(crop.shape[0], -1))


def image_inputs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.random((n, 64, 64)).astype(np.float32)


def crop_inputs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.random((n, 16, 16)).astype(np.float32)


# Model bundles only: the meta region_pipeline is checked end to end in tests/test_meta.py.
REFERENCES = {
    "classifier": (classifier_inputs, classifier_reference),
    "severity_grader": (grader_inputs, grader_reference),
    "region_scorer": (image_inputs, scorer_reference),
    "patch_classifier": (crop_inputs, patch_classifier_reference),
}


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def examples(examples_dir) -> dict[str, Bundle]:
    found = scan(examples_dir)
    for name, b in found.items():
        assert isinstance(b, Bundle), f"{name}: {b}"
    return found


@pytest.fixture(scope="module")
def compiled(examples):
    compiler = Compiler()
    return {
        name: (compile_bundle(b, compiler), weights_to_device(b)) for name, b in examples.items()
    }


# -- execution against the references --------------------------------------------------------


def test_every_example_has_a_reference(examples):
    models = [name for name, b in examples.items() if b.kind == "model"]
    assert sorted(models) == sorted(REFERENCES)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_example_matches_numpy_reference_at_every_batch_size(examples, compiled, name):
    bundle = examples[name]
    model, weights = compiled[name]
    make_inputs, reference = REFERENCES[name]
    host_weights = load_file(str(bundle.path / "weights.safetensors"))
    assert bundle.batch_sizes and sorted(model.executables) == list(bundle.batch_sizes)
    rng = np.random.default_rng(42)
    (out_spec,) = bundle.signature.executable_outputs
    for n in bundle.batch_sizes:
        x = make_inputs(rng, n)
        (got,) = model.run(n, [x], weights)
        assert got.dtype == out_spec.dtype.numpy
        assert got.shape == (n, *out_spec.shape[1:])
        np.testing.assert_allclose(
            got,
            reference(host_weights, x),
            rtol=1e-4,
            atol=1e-4,
            err_msg=f"{name} at batch size {n}",
        )


def test_grader_pipeline_grades(examples, compiled):
    """Module logits -> model.py postprocess: grades equal the reference CORAL grades."""
    bundle = examples["severity_grader"]
    model, weights = compiled["severity_grader"]
    host_weights = load_file(str(bundle.path / "weights.safetensors"))
    hook = bundle.hooks.postprocess
    assert (hook.inputs, hook.outputs) == (("logits",), ("grade",))
    rng = np.random.default_rng(3)
    # black, mid-grey, white, then random images; brightness dominates the CORAL score
    images = np.concatenate(
        [
            np.stack([np.full((32, 32, 3), v, np.uint8) for v in (0, 128, 255)]),
            grader_inputs(rng, 5),
        ]
    )
    (logits,) = model.run(8, [images], weights)
    reference = grader_reference(host_weights, images)
    assert np.abs(reference).min() > 1e-2  # no logit close enough to 0 to flip a grade
    grades = hook.apply({"logits": logits})["grade"]
    assert grades.dtype == np.int64 and grades.shape == (8,)
    np.testing.assert_array_equal(grades, coral_grade(reference))
    assert list(grades[:3]) == [0, 3, 6]


@pytest.mark.parametrize(
    ("row", "grade"),
    [
        ([1.0, -1.0, 1.0], 1),  # the early break: later positives do not count
        ([-1.0, 1.0, 1.0], 0),
        ([0.0, 1.0, 1.0], 0),  # zero is not positive
        ([2.0, 1.0, 0.5], 3),
        ([5.0, 3.0, 1.0, -1.0, 2.0, 4.0], 3),
        ([1.0] * 6, 6),
        ([-1.0] * 6, 0),
    ],
)
def test_grader_postprocess_early_break(examples, row, grade):
    hook = examples["severity_grader"].hooks.postprocess
    logits = np.array([row], np.float32)
    got = hook.apply({"logits": logits})["grade"]
    assert got.tolist() == [grade]
    assert coral_grade(logits).tolist() == [grade]


def test_grader_postprocess_matches_reference_on_random_logits(examples):
    hook = examples["severity_grader"].hooks.postprocess
    logits = np.random.default_rng(5).standard_normal((64, 6)).astype(np.float32) + 1.0
    np.testing.assert_array_equal(hook.apply({"logits": logits})["grade"], coral_grade(logits))


# -- reproducibility -------------------------------------------------------------------------


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_make_bundles_reproduces_examples_byte_for_byte(repo_root, examples_dir, tmp_path):
    out = tmp_path / "bundles"
    subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "make_bundles.py"), str(out)],
        cwd=tmp_path,
        check=True,
        timeout=300,
    )
    built, committed = _files(out), _files(examples_dir)
    assert sorted(built) == sorted(committed)
    for name, data in committed.items():
        assert built[name] == data, f"bundles/{name} differs from what make_bundles.py writes"
    # and the rebuilt repository loads like the committed one
    assert load_bundle(out / "classifier").batch_sizes == (1, 4, 8)
