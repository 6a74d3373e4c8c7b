"""Numpy references (float64) of the example bundles in bundles/, written from their
weights files alone, and inputs to feed them."""

from __future__ import annotations

import functools

import numpy as np
from safetensors.numpy import load_file

from support import BUNDLES


@functools.cache
def example_weights(name: str) -> dict[str, np.ndarray]:
    """The weights of example bundle ``name``, as stored (do not modify: shared)."""
    return load_file(str(BUNDLES / name / "weights.safetensors"))


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


#: Model bundles only: the meta region_pipeline is checked end to end in tests/e2e/test_meta.py.
REFERENCES = {
    "classifier": (classifier_inputs, classifier_reference),
    "severity_grader": (grader_inputs, grader_reference),
    "region_scorer": (image_inputs, scorer_reference),
    "patch_classifier": (crop_inputs, patch_classifier_reference),
}
