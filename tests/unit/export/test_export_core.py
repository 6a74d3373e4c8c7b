"""``rsrv.export.export_jax``: what it writes, and the arity gate that refuses to write."""

from __future__ import annotations

import functools
import json
import re
import stat
from pathlib import Path

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from safetensors import safe_open

from rsrv.bundle import UNBATCHED, TensorSpec, load_bundle
from rsrv.bundle._stablehlo import read_module, read_signature
from rsrv.dtypes import DType
from rsrv.export import ExportError, Input, Output, _writer, export_jax
from rsrv.runtime import Compiler, compile_bundle, weights_to_device

MAGIC = b"ML\xefR"  # StableHLO portable artifact (MLIR bytecode)


def params() -> dict:
    rng = np.random.default_rng(0)
    return {
        "layers": [
            {
                "w": rng.standard_normal((4, 3)).astype(np.float32),
                "b": rng.standard_normal(3).astype(np.float32),
            }
        ],
        "scale": np.float32(2.0),
        "emb": {"table": np.arange(6, dtype=np.int32).reshape(2, 3)},
    }


ORDER = ["emb.table", "layers.0.b", "layers.0.w", "scale"]  # tree-path order


def forward(p, x, ids):
    layer = p["layers"][0]
    y = (x @ layer["w"] + layer["b"]) * p["scale"]
    return y, p["emb"]["table"][ids, 0]  # dtype-stable whatever jax_enable_x64 says


def export(out_dir, **overrides):
    kwargs = dict(
        inputs=[
            Input("x", np.float32, ("n", 4), letters="nf"),
            Input("ids", np.int32, ("n",), letters="n"),
        ],
        outputs=[Output("y", letters="nk"), Output("s")],
        batch_sizes=[2, 1, 2],
        out_dir=out_dir,
        description="test model",
        provenance={"source": "tests"},
    )
    kwargs.update(overrides)
    return export_jax(forward, params(), **kwargs)


def test_writes_manifest_modules_and_weights(tmp_path):
    out = export(tmp_path / "m")
    assert out == tmp_path / "m"
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.yaml",
        "model.b1.mlir",
        "model.b2.mlir",
        "weights.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging left behind
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}

    assert msgspec.yaml.decode((out / "manifest.yaml").read_bytes()) == {
        "format_version": "2.0",
        "kind": "model",
        "description": "test model",
        "executable_inputs": [
            {"name": "x", "dtype": "f32", "shape": "nf", "dims": {"f": 4}},
            {"name": "ids", "dtype": "i32", "shape": "n", "dims": {}},
        ],
        "executable_outputs": [
            {"name": "y", "dtype": "f32", "shape": "nk", "dims": {"k": 3}},
            {"name": "s", "dtype": "i32", "shape": "n", "dims": {}},
        ],
        "batching": {"compiled_batch_sizes": [1, 2]},
        "provenance": {"source": "tests"},
    }

    with safe_open(str(out / "weights.safetensors"), "np") as f:
        assert json.loads(f.metadata()["argument_order"]) == ORDER
        flat = dict(zip(ORDER, jax.tree_util.tree_leaves(params()), strict=True))
        for name in ORDER:
            np.testing.assert_array_equal(f.get_tensor(name), flat[name])

    for n in (1, 2):
        module = read_module(out / f"model.b{n}.mlir")
        assert isinstance(module, bytes) and module.startswith(MAGIC)
        sig = read_signature(module)
        assert [(a.dtype, a.shape) for a in sig.inputs] == [
            (DType.F32, (n, 4)),
            (DType.I32, (n,)),  # inputs, in order
            (DType.I32, (2, 3)),
            (DType.F32, (3,)),
            (DType.F32, (4, 3)),
            (DType.F32, ()),
        ]
        assert [(a.dtype, a.shape) for a in sig.outputs] == [(DType.F32, (n, 3)), (DType.I32, (n,))]


def test_exported_bundle_loads_and_runs_like_jax(tmp_path):
    bundle = load_bundle(export(tmp_path / "m"))
    assert bundle.batch_sizes == (1, 2)
    assert [w.name for w in bundle.weights.weights] == ORDER
    model = compile_bundle(bundle, Compiler())
    weights = weights_to_device(bundle)
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    ids = np.array([0, 1], np.int32)
    y, s = model.run(2, [x, ids], weights)
    want_y, want_s = forward(params(), x, ids)
    np.testing.assert_allclose(y, want_y, rtol=1e-6)
    np.testing.assert_array_equal(s, want_s)


def test_export_is_deterministic(tmp_path):
    a, b = export(tmp_path / "a"), export(tmp_path / "b")
    for file in a.iterdir():
        assert file.read_bytes() == (b / file.name).read_bytes(), file.name


def test_reexport_replaces_the_bundle_as_a_whole(tmp_path):
    out = export(tmp_path / "m")
    export(tmp_path / "m", batch_sizes=[4])  # model.b1.mlir and model.b2.mlir go
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.yaml",
        "model.b4.mlir",
        "weights.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing staged is left


def test_reexport_swaps_the_bundle_in_one_step(tmp_path, monkeypatch):
    """A reader never finds the directory missing (a repository scan would unload the
    model): the two directories are exchanged, never renamed one after the other."""
    out = export(tmp_path / "m")
    renamed = []
    rename = Path.rename
    monkeypatch.setattr(Path, "rename", lambda p, to: renamed.append(p) or rename(p, to))
    export(tmp_path / "m", batch_sizes=[4])
    assert renamed == [] and (out / "model.b4.mlir").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            {"notes.md": "mine"},
            "exists and holds no bundle (no manifest), which an export would delete",
        ),
        ({"manifest.yaml": "", "labels.txt": "cat"}, "holds files a bundle export does not "),
        ({"1/manifest.yaml": "", "2/notes": ""}, "holds version directories (1, 2)"),
    ],
)
def test_export_refuses_to_replace_what_is_not_a_bundle(tmp_path, layout, message):
    """An export replaces its directory as a whole: one holding anything but a bundle's
    own files is refused before any work, and left as it was."""
    for name, text in layout.items():
        (tmp_path / "m" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "m" / name).write_text(text)
    with pytest.raises(ExportError, match=f"^{tmp_path / 'm'} {re.escape(message)}"):
        export(tmp_path / "m")
    assert {
        str(p.relative_to(tmp_path / "m")): p.read_text()
        for p in (tmp_path / "m").rglob("*")
        if p.is_file()
    } == layout
    _assert_nothing_written(tmp_path, keep=["m"])


def test_an_empty_directory_is_exported_into(tmp_path):
    (tmp_path / "m").mkdir()
    export(tmp_path / "m")
    assert (tmp_path / "m" / "manifest.yaml").is_file()


def test_a_failed_swap_leaves_the_old_bundle(tmp_path, monkeypatch):
    """Where the two directories cannot be exchanged in one step: an interrupt while the
    new bundle is renamed into place puts the old one back."""
    out = export(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rename = Path.rename
    monkeypatch.setattr(_writer, "_exchange", lambda a, b: False)

    def interrupted(self, target):
        if self.name.startswith(".m-") and "-old-" not in self.name:
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(tmp_path / "m", batch_sizes=[4])
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_unbatched_export_writes_model_mlir(tmp_path):
    out = export_jax(
        lambda p, x: x * p["k"],
        {"k": np.float32(3.0)},
        inputs=[Input("x", np.float32, (5,))],
        outputs=["y"],
        batch_sizes=[1, 8],
        out_dir=tmp_path / "u",
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.yaml",
        "model.mlir",
        "weights.safetensors",
    ]
    doc = msgspec.yaml.decode((out / "manifest.yaml").read_bytes())
    assert doc.get("batching", {}).get("compiled_batch_sizes", []) == []
    assert doc["executable_inputs"] == [
        {"name": "x", "dtype": "f32", "shape": "a", "dims": {"a": 5}}
    ]
    bundle = load_bundle(out)
    assert list(bundle.modules) == [UNBATCHED] and bundle.batch_sizes == ()


def test_model_without_weights(tmp_path):
    out = export_jax(
        lambda p, x: x * 2,
        {},
        inputs=[Input("x", np.float32, ("n", 2))],
        outputs=["y"],
        batch_sizes=[1],
        out_dir=tmp_path / "w",
    )
    with safe_open(str(out / "weights.safetensors"), "np") as f:
        assert f.metadata() == {"argument_order": "[]"} and list(f.keys()) == []
    bundle = load_bundle(out)
    assert bundle.weights.weights == () and weights_to_device(bundle) == []
    (y,) = compile_bundle(bundle, Compiler()).run(1, [np.array([[1, 2]], np.float32)], [])
    np.testing.assert_array_equal(y, [[2, 4]])


def test_model_py_and_client_tensors(tmp_path):
    model_py = (
        "import rsrv\n\n@rsrv.postprocess(inputs=['y'], outputs=['top'])\n"
        "def top(y):\n    return y.argmax(-1)\n"
    )
    out = export(
        tmp_path / "m",
        client_outputs=[
            TensorSpec(name="top", dtype="i64", shape="n"),
            TensorSpec(name="s", dtype="i32", shape="n"),
        ],
        model_py=model_py,
    )
    assert (out / "model.py").read_text() == model_py
    bundle = load_bundle(out)
    assert [t.name for t in bundle.signature.client_outputs] == ["top", "s"]
    assert bundle.hooks.postprocess.outputs == ("top",)


# -- refusals: ExportError, and nothing written ----------------------------------------------


def _assert_nothing_written(tmp_path, keep=()):
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(keep), f"export left {left}"


def test_arity_gate_on_an_extra_argument(tmp_path, monkeypatch):
    """A traced program with one argument more than inputs + weights is refused.

    jax 0.10 adds real extra entry arguments for dimension variables (shape polymorphism,
    which export_jax never requests: shapes are concrete), for ordered-effect tokens (only
    host callbacks have ordered effects, and jax refuses to serialize those before the
    gate is reached: see the next test), and for the platform index of a multi-platform
    export. The last is provoked here, by making export_jax's jax.export.export lower for
    two platforms: jax itself then prepends an i32 platform-index argument to main.
    """
    real_export = jax.export.export
    monkeypatch.setattr(
        jax.export, "export", functools.partial(real_export, platforms=("cpu", "cuda"))
    )
    with pytest.raises(ExportError) as info:
        export(tmp_path / "m")
    assert str(info.value) == (
        "UNSERVABLE: the compiled entry takes 7 arguments but rsrv calls it with 6 "
        "(2 inputs + 4 weights). The likely cause is state lifted into extra arguments (an "
        "RNG key, a mutable collection, an effect token); make it a parameter or an input, "
        "or close over nothing stateful."
    )
    _assert_nothing_written(tmp_path)


def test_arity_gate_keeps_an_existing_bundle(tmp_path, monkeypatch):
    out = export(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_export = jax.export.export
    monkeypatch.setattr(
        jax.export, "export", functools.partial(real_export, platforms=("cpu", "cuda"))
    )
    with pytest.raises(ExportError):
        export(tmp_path / "m", batch_sizes=[4])
    _assert_nothing_written(tmp_path, keep=["m"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_ordered_effect_is_refused_and_writes_nothing(tmp_path):
    """An ordered effect would add a token argument; jax 0.10 cannot serialize the host
    callback behind it, so the export fails before the gate. Either way: nothing written."""

    def noisy(p, x):
        jax.debug.print("x = {}", x.sum(), ordered=True)
        return x * p["k"]

    with pytest.raises((ExportError, NotImplementedError)):
        export_jax(
            noisy,
            {"k": np.float32(1.0)},
            inputs=[Input("x", np.float32, ("n", 2))],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "m",
        )
    _assert_nothing_written(tmp_path)


def test_output_count_mismatch(tmp_path):
    with pytest.raises(ExportError, match="^the function returns 2 outputs, 1 were named$"):
        export(tmp_path / "m", outputs=["y"])
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        # jax would flatten the dict, sorted: 'q' would have held the function's 'p'
        (
            lambda x: ({"q": x + 1, "p": x - 1},),
            "the function's output 'q' is a dict, not an array",
        ),
        (lambda x: (x, (x, x)), "the function's output 'p' is a tuple, not an array"),
        (lambda x: (x, None), "the function's output 'p' is a NoneType, not an array"),
        (lambda x: (x, (x,)), "the function's output 'p' is a tuple, not an array"),
        (
            lambda x: {"q": x, "p": x, "debug": x},
            "the function returns a mapping whose keys are not the outputs named: "
            "not named 'debug'",
        ),
        (
            lambda x: {"q": x},
            "the function returns a mapping whose keys are not the outputs named: missing 'p'",
        ),
    ],
)
def test_a_result_that_is_not_one_array_per_named_output_is_refused(tmp_path, returns, message):
    with pytest.raises(ExportError) as info:
        export_jax(
            lambda p, x: returns(x),
            {},
            inputs=[Input("x", np.float32, ("n", 3))],
            outputs=["q", "p"],
            batch_sizes=[2],
            out_dir=tmp_path / "m",
            parity=False,
        )
    assert str(info.value).startswith(message)
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize("axis", [-1, 1.0, True])
def test_a_batch_axis_that_is_not_an_index_from_0_is_refused(axis):
    with pytest.raises(ExportError) as info:
        Output("y", batch_axis=axis)
    assert str(info.value) == (
        f"output 'y': batch_axis {axis!r} must be None or an axis index counted from 0"
    )


def test_a_provenance_the_manifest_cannot_hold_is_refused_before_tracing(tmp_path):
    with pytest.raises(ExportError) as info:
        export(tmp_path / "m", provenance={"accuracy": np.float32(0.9)})
    assert str(info.value).startswith(
        "provenance cannot be written to the manifest: Encoding objects of type "
        "numpy.float32 is unsupported; "
    )
    _assert_nothing_written(tmp_path)


def test_output_without_batch_axis(tmp_path):
    with pytest.raises(ExportError) as info:
        export(tmp_path / "m", outputs=[Output("y", batch_axis=1), "s"])
    assert str(info.value) == (
        "output 'y' has shape [2, 3]: axis 1 is not the batch axis (expected extent 2)"
    )
    _assert_nothing_written(tmp_path)


def test_letters_of_wrong_length(tmp_path):
    with pytest.raises(ExportError) as info:
        export(tmp_path / "m", outputs=[Output("y", letters="nkz"), "s"])
    assert str(info.value) == "letters 'nkz' name 3 axes, the tensor has 2"
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("inputs", "outputs", "message"),
    [
        (
            [Input("x", np.float32, ("n", 4), letters="fn"), Input("ids", np.int32, ("n",))],
            [Output("y"), Output("s")],
            "letters 'fn': the batch letter 'n' belongs at axis 0 only (the tensor's batch axis)",
        ),
        (
            [Input("x", np.float32, ("n", 4)), Input("ids", np.int32, ("n",))],
            [Output("y", letters="kn"), Output("s")],
            "letters 'kn': the batch letter 'n' belongs at axis 0 only",
        ),
    ],
)
def test_the_batch_letter_must_be_on_the_batch_axis(tmp_path, inputs, outputs, message):
    with pytest.raises(ExportError) as info:
        export(tmp_path / "m", inputs=inputs, outputs=outputs, parity=False)
    assert str(info.value).startswith(message)
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            Input("x", "f32", ("n", 4)),
            "input 'x': dtype 'f32' is not a numpy dtype a bundle holds (for the manifest's "
            "'f32' pass np.float32)",
        ),
        (Input("x", np.complex64, ("n", 4)), "input 'x': dtype <class 'numpy.complex64'> is"),
        (Input("x", np.float32, ("n", "n")), "input 'x': shape ('n', 'n'): expected a tuple"),
        (Input("x", np.float32, ("n", -1)), "input 'x': shape ('n', -1): expected a tuple"),
        (Input("x", np.float32, ("n", 4.0)), "input 'x': shape ('n', 4.0): expected a tuple"),
    ],
)
def test_inputs_are_checked_before_tracing(tmp_path, given, message):
    with pytest.raises(ExportError) as info:
        export_jax(
            lambda p, x: x,
            {},
            inputs=[given],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "m",
        )
    assert str(info.value).startswith(message)
    _assert_nothing_written(tmp_path)


def test_an_output_of_a_dtype_a_bundle_cannot_hold_is_refused(tmp_path):
    with pytest.raises(ExportError) as info:
        export_jax(
            lambda p, x: jnp.fft.fft(x),
            {},
            inputs=[Input("x", np.float32, ("n", 4))],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "m",
        )
    assert str(info.value) == "output 'y' has dtype complex64, which a bundle cannot hold"
    _assert_nothing_written(tmp_path)


def test_an_output_whose_shape_depends_on_the_batch_size_otherwise_is_refused(tmp_path):
    """Judged at every traced size, not only the largest: ``y`` is [4] whatever the
    batch size, so at size 4 its axis 0 looks like the batch axis."""
    with pytest.raises(ExportError) as info:
        export_jax(
            lambda p, x: x.sum(axis=0) + jnp.zeros(4),
            {},
            inputs=[Input("x", np.float32, ("n", 4))],
            outputs=["y"],
            batch_sizes=[1, 4],
            out_dir=tmp_path / "m",
            parity=False,
        )
    assert str(info.value) == (
        "output 'y' has shape [4]: axis 0 is not the batch axis (expected extent 1)"
    )
    _assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"client_outputs": [TensorSpec(name="y", dtype="f32", shape="nk", dims={"k": 3})]},
            "client_outputs: only valid when model.py transforms I/O, and m has no model.py",
        ),
        ({"model_py": "raise ValueError('broken')\n"}, "model.py"),
    ],
)
def test_without_the_parity_gate_the_bundle_is_still_loaded_before_the_swap(
    tmp_path, overrides, message
):
    """What a worker's loader refuses is refused with ``parity=False`` too, naming the
    bundle's directory (not its staging directory), and nothing is written."""
    with pytest.raises(ExportError) as info:
        export(tmp_path / "m", parity=False, **overrides)
    assert str(info.value).startswith(f"the written bundle would not load: {tmp_path / 'm'}")
    assert message in str(info.value)
    _assert_nothing_written(tmp_path)


def test_a_bundle_the_loader_would_refuse_is_refused_before_writing(tmp_path):
    """Without the parity gate too (which only loaded the bundle it had written)."""
    with pytest.raises(ExportError, match="would not load: .*every output needs the batch"):
        export(tmp_path / "m", outputs=[Output("y"), Output("s", batch_axis=None)], parity=False)
    _assert_nothing_written(tmp_path)
