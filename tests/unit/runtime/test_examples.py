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
from support.references import (
    REFERENCES,
    coral_grade,
    example_weights,
    grader_inputs,
    grader_reference,
)

from rsrv.bundle import Bundle, load_bundle, scan
from rsrv.runtime import Compiler, compile_bundle, weights_to_device

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
    host_weights = example_weights(name)
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
    host_weights = example_weights("severity_grader")
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
