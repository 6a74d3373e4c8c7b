"""Bundle loading and validation: one test per broken-bundle case, each with its exact message.

Every broken bundle starts as a valid copy of a tiny exported model (``tiny_bundle``:
x f32[n,3] -> y f32[n,2], batch sizes 1 and 2, weights b and w) with one thing broken.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import msgspec
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.bundles import export_linear, linear_params, write_weights

from rsrv.bundle import (
    Bundle,
    discover,
    load_bundle,
    model_versions,
    scan,
    version_policy_of,
)
from rsrv.bundle._manifest import Manifest, decode_manifest, resolve_manifest
from rsrv.bundle._stablehlo import read_module
from rsrv.bundle_check import check_main
from rsrv.errors import BundleError, Internal
from rsrv.export import Input, export_jax
from rsrv.runtime import Compiler, compile_bundle, weights_to_device
from rsrv.versions import VersionPolicy

TOKENS = (
    "('f16', 'f32', 'f64', 'bf16', 'i8', 'i16', 'i32', 'i64', 'u8', 'u16', 'u32', "
    "'u64', 'bool', 'bytes')"
)

TINY_TOML = """\
format_version = "2.0"
kind = "model"
description = ""

[[executable_inputs]]
name = "x"
dtype = "f32"
shape = "nf"
dims = { f = 3 }

[[executable_outputs]]
name = "y"
dtype = "f32"
shape = "nk"
dims = { k = 2 }

[batching]
compiled_batch_sizes = [1, 2]
"""

META_MANIFEST = {
    "format_version": "2.0",
    "kind": "meta",
    "client_inputs": [{"name": "x", "dtype": "f32", "shape": "nf", "dims": {"f": 3}}],
    "client_outputs": [{"name": "y", "dtype": "f32", "shape": "nk", "dims": {"k": 2}}],
    "meta": {"calls": ["tiny"]},
}

META_MODEL_PY = """\
import rsrv


@rsrv.meta(inputs=["x"], outputs=["y"])
def run(call, x):
    return call("tiny", {"x": x})["y"]
"""

GRADE_MODEL_PY = """\
import numpy as np

import rsrv


@rsrv.postprocess(inputs=["{input}"], outputs=["label"])
def label(y):
    return np.argmax(y, axis=-1)
"""


# -- helpers ---------------------------------------------------------------------------------


def edit(bundle: Path, change) -> None:
    """Apply ``change(doc)`` to the bundle's manifest.yaml, a plain dict."""
    path = bundle / "manifest.yaml"
    doc = msgspec.yaml.decode(path.read_bytes())
    change(doc)
    path.write_bytes(msgspec.yaml.encode(doc))


def error(bundle: Path) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(bundle)
    return str(info.value)


def write_meta(
    repo: Path, manifest: dict, model_py: str | None = META_MODEL_PY, name: str = "ensemble"
) -> Path:
    bundle = repo / name
    bundle.mkdir(parents=True)
    (bundle / "manifest.yaml").write_bytes(msgspec.yaml.encode(manifest))
    if model_py is not None:
        (bundle / "model.py").write_text(model_py)
    return bundle


def tiny_weights(bundle: Path) -> dict[str, np.ndarray]:
    return load_file(str(bundle / "weights.safetensors"))


# -- the valid bundle ------------------------------------------------------------------------


def test_tiny_bundle_loads(tiny_bundle):
    b = load_bundle(tiny_bundle)
    assert b.name == "tiny" and b.kind == "model"
    assert b.batch_sizes == (1, 2)
    assert b.modules == {1: tiny_bundle / "model.b1.mlir", 2: tiny_bundle / "model.b2.mlir"}
    assert [w.name for w in b.weights.weights] == ["b", "w"]
    assert b.weight_bytes == (2 + 6) * 4
    sig = b.signature
    assert [t.describe() for t in sig.executable_inputs] == ["x: f32[n,3]"]
    assert [t.describe() for t in sig.executable_outputs] == ["y: f32[n,2]"]
    assert sig.client_inputs == sig.executable_inputs and sig.batched


# -- manifest syntax and structure -----------------------------------------------------------


def test_bad_yaml_syntax(tiny_bundle):
    (tiny_bundle / "manifest.yaml").write_text("format_version: '2.0'\nexecutable_inputs: [\n")
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: cannot parse: while parsing a flow node did not find "
        "expected node content (at line 3, column 1)"
    )


def test_bad_toml_syntax(tiny_bundle):
    (tiny_bundle / "manifest.yaml").unlink()
    (tiny_bundle / "manifest.toml").write_text('format_version = "2.0"\nkind = model\n')
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.toml: cannot parse: Invalid value (at line 2, column 8)"
    )


def test_unknown_top_level_field(tiny_bundle):
    edit(tiny_bundle, lambda d: d.update(max_batch=8))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: Object contains unknown field `max_batch`"
    )


def test_unknown_nested_field(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0].update(layout="NHWC"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[0]: Object contains unknown field `layout`"
    )


def test_wrong_field_type(tiny_bundle):
    edit(tiny_bundle, lambda d: d["batching"].update(compiled_batch_sizes=[1, "two"]))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: batching.compiled_batch_sizes[1]: Expected `int`, got `str`"
    )


def test_missing_manifest(tiny_bundle):
    (tiny_bundle / "manifest.yaml").unlink()
    assert error(tiny_bundle) == (
        f"{tiny_bundle}: no manifest (manifest.yaml or manifest.yml or manifest.toml)"
    )


def test_yaml_next_to_toml(tiny_bundle):
    (tiny_bundle / "manifest.toml").write_text(TINY_TOML)
    assert error(tiny_bundle) == (
        f"{tiny_bundle}: more than one manifest (manifest.yaml, manifest.toml)"
    )


# -- tensor specs ----------------------------------------------------------------------------


def test_bad_dtype(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0].update(dtype="float32"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[0].dtype: unknown dtype 'float32' "
        f"(expected one of {TOKENS})"
    )


def test_bytes_on_executable_tensor(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_outputs"][0].update(dtype="bytes"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_outputs[0].dtype: 'bytes' is only allowed on "
        "client_inputs/client_outputs (model.py converts it; a compiled module cannot take "
        "strings)"
    )


def test_duplicate_letters(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0].update(shape="nff"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[0].shape: 'nff': letter 'f' appears twice"
    )


def test_non_letter_in_shape(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0].update(shape="n3"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[0].shape: 'n3': '3' is not an ASCII letter"
    )


def test_reserved_batch_letter_in_dims(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0]["dims"].update(n=4))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[0].dims: letter 'n' is reserved for the "
        "batch axis and takes no size"
    )


def test_letter_without_size(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0].update(shape="nhw", dims={"h": 3}))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[0].dims: letter 'w' of shape 'nhw' "
        "has no size"
    )


def test_orphan_dims_key(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_outputs"][0]["dims"].update(c=5))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_outputs[0].dims.c: letter 'c' does not appear "
        "in shape 'nk'"
    )
    edit(tiny_bundle, lambda d: d["executable_outputs"][0].update(dims={"k": 2, "nk": 5}))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_outputs[0].dims.nk: a key is one letter of "
        "shape 'nk'"
    )


@pytest.mark.parametrize("size", [0, -2])
def test_non_positive_dim(tiny_bundle, size):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0]["dims"].update(f=size))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[0].dims.f: size must be positive or -1 "
        f"(variable), got {size}"
    )


def test_wrong_format_version(tiny_bundle):
    edit(tiny_bundle, lambda d: d.update(format_version="1.0"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: format_version: unsupported version '1.0' (expected \"2.0\")"
    )


def test_duplicate_tensor_names(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"].append(dict(d["executable_inputs"][0])))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs[1].name: duplicate tensor name 'x'"
    )


def test_mixed_batched_and_unbatched_inputs(tiny_bundle):
    extra = {"name": "scale", "dtype": "f32", "shape": "f", "dims": {"f": 3}}
    edit(tiny_bundle, lambda d: d["executable_inputs"].append(extra))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_inputs: mixes batched and unbatched inputs; "
        "every input needs the batch letter 'n' or none does (unbatched: scale)"
    )


def test_batched_inputs_with_unbatched_output(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_outputs"][0].update(shape="k"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: executable_outputs: inputs are batched, so every output "
        "needs the batch letter 'n' (missing in: y)"
    )


def test_non_positive_batch_size(tiny_bundle):
    edit(tiny_bundle, lambda d: d["batching"].update(compiled_batch_sizes=[1, 0]))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: batching.compiled_batch_sizes[1]: must be positive, got 0"
    )


# -- module files ----------------------------------------------------------------------------


def test_missing_module_for_declared_batch_size(tiny_bundle):
    edit(tiny_bundle, lambda d: d["batching"].update(compiled_batch_sizes=[1, 2, 4]))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b4.mlir: missing (declared by manifest.yaml "
        "batching.compiled_batch_sizes)"
    )


def test_a_module_named_with_leading_zeros_is_not_a_module(tiny_bundle):
    """(model.b01.mlir would stand for batch size 1 beside model.b1.mlir, one of them
    dropped by directory order)"""
    (tiny_bundle / "model.b1.mlir").rename(tiny_bundle / "model.b01.mlir")
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b01.mlir: not a module name: model.b<N>.mlir takes a batch "
        "size N from 1, without leading zeros"
    )


@pytest.mark.parametrize("name", ["model.b0.mlir", "model.b1x.mlir"])
def test_another_model_b_mlir_is_refused_not_ignored(tiny_bundle, name):
    """specs/bundle.md section 4: no other model.b*.mlir (they were passed over)."""
    shutil.copy(tiny_bundle / "model.b1.mlir", tiny_bundle / name)
    assert error(tiny_bundle).startswith(f"{tiny_bundle}/{name}: not a module name")


@pytest.mark.parametrize("file", ["model.py", "weights.safetensors", "model.b1.mlir"])
@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("dangling", "a symbolic link that does not lead to a file"),
        ("loop", "a symbolic link that does not lead to a file"),
        ("directory", "a directory"),
        ("fifo", "not a regular file"),
    ],
)
def test_a_bundle_file_that_is_not_a_regular_file_is_refused(tiny_bundle, file, kind, what):
    """A dangling model.py was taken for none (the model served without its hooks); a
    FIFO module hung the loader; a looping weights file was reported missing."""
    path = tiny_bundle / file
    path.unlink(missing_ok=True)
    if kind == "dangling":
        path.symlink_to(tiny_bundle / "nowhere")
    elif kind == "loop":
        path.symlink_to(path)
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    assert error(tiny_bundle) == f"{path}: {what}"


def test_a_dangling_manifest_is_a_model_that_fails_not_nothing(tiny_bundle):
    """A model directory whose manifest is a dangling link was skipped by discovery
    (the repository and `rsrv bundle check REPO` said nothing of it)."""
    manifest = tiny_bundle / "manifest.yaml"
    manifest.unlink()
    manifest.symlink_to(tiny_bundle / "gone.yaml")
    assert discover(tiny_bundle.parent) == [tiny_bundle]
    assert error(tiny_bundle) == f"{manifest}: a symbolic link that does not lead to a file"


def test_undeclared_extra_module(tiny_bundle):
    shutil.copy(tiny_bundle / "model.b1.mlir", tiny_bundle / "model.b3.mlir")
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b3.mlir: batch size 3 is not in manifest.yaml "
        "batching.compiled_batch_sizes"
    )


def test_single_model_mlir_next_to_batch_sizes(tiny_bundle):
    shutil.copy(tiny_bundle / "model.b1.mlir", tiny_bundle / "model.mlir")
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.mlir: ambiguous next to batching.compiled_batch_sizes [1, 2]; "
        "use only model.b<N>.mlir files"
    )


def test_module_that_is_not_stablehlo(tiny_bundle):
    (tiny_bundle / "model.b2.mlir").write_text("this is not MLIR\n")
    assert error(tiny_bundle).startswith(f"{tiny_bundle}/model.b2.mlir: not a StableHLO module: ")


def test_module_that_is_neither_bytecode_nor_text(tiny_bundle):
    (tiny_bundle / "model.b2.mlir").write_bytes(b"\x1f\x8b\x08\x00 gzip, say")
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b2.mlir: not a StableHLO module: neither bytecode nor UTF-8 "
        "text (byte 1 is 0x8b)"
    )


def test_module_argument_count(tiny_bundle, tmp_path):
    """A module traced with one more input than the manifest declares."""
    other = export_jax(
        lambda p, x, t: x @ p["w"] + p["b"] + t,
        {"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)},
        inputs=[Input("x", np.float32, ("n", 3)), Input("t", np.float32, ("n", 2))],
        outputs=["y"],
        batch_sizes=[1, 2],
        out_dir=tmp_path / "other",
    )
    for name in ("model.b1.mlir", "model.b2.mlir"):
        shutil.copy(other / name, tiny_bundle / name)
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: main takes 4 arguments, expected 3 "
        "(1 executable_inputs + 2 weights in argument_order)"
    )


def test_module_argument_dtype(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0].update(dtype="f64"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: argument 0 ('x') has dtype f32, expected f64"
    )


def test_module_argument_shape(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_inputs"][0]["dims"].update(f=4))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: argument 0 ('x') has shape [1, 3], expected [1, 4]"
    )


def test_module_weight_argument_shape(tiny_bundle):
    w = tiny_weights(tiny_bundle)
    write_weights(
        tiny_bundle / "weights.safetensors",
        {"b": w["b"], "w": np.zeros((4, 2), np.float32)},
        ["b", "w"],
    )
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: argument 2 (weight 'w') has shape [3, 2], expected [4, 2]"
    )


def test_module_weight_argument_order(tiny_bundle):
    write_weights(tiny_bundle / "weights.safetensors", tiny_weights(tiny_bundle), ["w", "b"])
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: argument 1 (weight 'w') has shape [2], expected [3, 2]"
    )


def test_module_output_count(tiny_bundle):
    extra = {"name": "z", "dtype": "f32", "shape": "nk", "dims": {"k": 2}}
    edit(tiny_bundle, lambda d: d["executable_outputs"].append(extra))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: main returns 1 results, expected 2 (executable_outputs)"
    )


def test_module_output_dtype(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_outputs"][0].update(dtype="f16"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: result 0 ('y') has dtype f32, expected f16"
    )


def test_module_output_shape(tiny_bundle):
    edit(tiny_bundle, lambda d: d["executable_outputs"][0]["dims"].update(k=3))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.b1.mlir: result 0 ('y') has shape [1, 2], expected [1, 3]"
    )


def test_a_variable_executable_extent_takes_the_modules_static_one(tiny_bundle):
    """-1 on an executable tensor matches the module's extent, and is then that extent:
    a request of another extent is refused at decoding (not failed by the runtime), for
    the client tensors that default to the executable ones too."""
    edit(tiny_bundle, lambda d: d["executable_inputs"][0]["dims"].update(f=-1))
    sig = load_bundle(tiny_bundle).signature
    assert sig.executable_inputs[0].shape == (-1, 3)
    assert sig.client_inputs[0].shape == (-1, 3)
    assert sig.client_inputs[0].describe() == "x: f32[n,3]"


def test_a_variable_extent_must_be_the_same_in_every_module(tmp_path):
    src = export_linear(tmp_path / "m", seed=0)  # x f32[n,3] at sizes 1, 2, 4
    edit(src, lambda d: d["executable_inputs"][0]["dims"].update(f=-1))
    other = export_jax(
        lambda p, x: x[:, :3] @ p["w"] + p["b"],
        linear_params(0),
        inputs=[Input("x", np.float32, ("n", 5))],
        outputs=["y"],
        batch_sizes=[2],
        out_dir=tmp_path / "five",
        parity=False,
    )
    (src / "model.b2.mlir").write_bytes((other / "model.b2.mlir").read_bytes())
    assert error(src) == (
        f"{src}: 'x' axis 1 ('f': -1) is 3 in one module, 5 in another: a variable extent "
        "must be the same in every module"
    )


# -- weights ---------------------------------------------------------------------------------


def test_missing_weights(tiny_bundle):
    (tiny_bundle / "weights.safetensors").unlink()
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/weights.safetensors: missing (every model bundle has a weights file)"
    )


def test_argument_order_names_absent_tensor(tiny_bundle):
    write_weights(
        tiny_bundle / "weights.safetensors", tiny_weights(tiny_bundle), ["b", "w", "scale"]
    )
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/weights.safetensors: argument_order names tensor 'scale', which the "
        "file does not contain"
    )


def test_safetensors_without_argument_order(tiny_bundle):
    write_weights(tiny_bundle / "weights.safetensors", tiny_weights(tiny_bundle), metadata=False)
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/weights.safetensors: has tensors but no 'argument_order' metadata (a "
        "JSON list of tensor names giving the executable's weight argument order)"
    )


def test_argument_order_not_a_list(tiny_bundle):
    save_file(
        tiny_weights(tiny_bundle),
        str(tiny_bundle / "weights.safetensors"),
        metadata={"argument_order": "b,w"},
    )
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/weights.safetensors: metadata 'argument_order' must be a JSON list of "
        "tensor names"
    )


def test_weights_not_safetensors(tiny_bundle):
    (tiny_bundle / "weights.safetensors").write_bytes(b"abc")
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/weights.safetensors: not a safetensors file (shorter than its 8-byte "
        "header length)"
    )


def raw_safetensors(path: Path, header) -> None:
    """A weights file whose JSON header is ``header`` as given (a valid file or not)."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(64))


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ([1, 2], "not a safetensors file (its header is not a JSON object)"),
        ({"__metadata__": ["w"]}, "__metadata__ must be a JSON object of strings"),
        (
            {"__metadata__": {"argument_order": ["w"]}, "w": {}},
            "metadata 'argument_order' must be a JSON list of tensor names",
        ),
        (
            {"__metadata__": {"argument_order": '["w"]'}, "w": {"dtype": "F32"}},
            "tensor 'w': shape must be a list of sizes >= 0, not None",
        ),
        (
            {
                "__metadata__": {"argument_order": '["w"]'},
                "w": {"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]},
            },
            "tensor 'w': shape must be a list of sizes >= 0, not [-1, -1]",
        ),
        (
            {
                "__metadata__": {"argument_order": '["w"]'},
                "w": {"dtype": "F32", "shape": [1], "data_offsets": [0]},
            },
            "tensor 'w': data_offsets must be [start, end], not [0]",
        ),
        (
            {
                "__metadata__": {"argument_order": '["w"]'},
                "w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
            },
            "tensor 'w' has unsupported dtype ['F32']",
        ),
        (
            {
                "__metadata__": {"argument_order": '["w", "w"]'},
                "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            "argument_order names tensor 'w' more than once",
        ),
        (
            {
                "__metadata__": {"argument_order": '["v", "w"]'},
                "v": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "tensors 'v' and 'w' overlap in the file",
        ),
    ],
)
def test_a_malformed_weights_header_is_a_bundle_error_naming_it(tiny_bundle, header, message):
    """Not a TypeError or KeyError out of the loader (which stopped a repository scan)."""
    raw_safetensors(tiny_bundle / "weights.safetensors", header)
    assert error(tiny_bundle) == f"{tiny_bundle}/weights.safetensors: {message}"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            struct.pack("<Q", 10**6) + b"{}",
            "its header length is 1000000 bytes, the file ends after 2",
        ),
        (
            struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
            "its header nests too deep",
        ),
    ],
)
def test_a_weights_file_that_is_no_safetensors_is_a_bundle_error(tiny_bundle, data, message):
    (tiny_bundle / "weights.safetensors").write_bytes(data)
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/weights.safetensors: not a safetensors file ({message})"
    )


# -- model.py --------------------------------------------------------------------------------


def test_model_py_failing_to_import(tiny_bundle):
    (tiny_bundle / "model.py").write_text("import rsrv\n\nraise RuntimeError('boom')\n")
    assert error(tiny_bundle) == (f"{tiny_bundle}/model.py: failed to import: RuntimeError: boom")


def test_model_py_syntax_error(tiny_bundle):
    (tiny_bundle / "model.py").write_text("def broken(:\n")
    assert error(tiny_bundle).startswith(f"{tiny_bundle}/model.py: failed to import: SyntaxError: ")


def test_an_async_hook_is_refused_at_import(tiny_bundle):
    """(it returned an unawaited coroutine: a client got its repr as a BYTES answer)"""
    (tiny_bundle / "model.py").write_text(
        "import rsrv\n\n\n"
        '@rsrv.postprocess(inputs=["y"], outputs=["y"])\n'
        "async def post(y):\n    return y\n"
    )
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.py: failed to import: TypeError: @rsrv.postprocess decorates a "
        "plain function, not async def 'post' (hooks run in a worker thread; a meta's call() "
        "blocks there)"
    )


def test_a_callable_object_hook_serves_and_is_named_by_its_class(tiny_bundle):
    """(A hook without __name__, a callable object or functools.partial, loaded READY and
    then failed every request: AttributeError, naming neither model nor hook.)"""
    (tiny_bundle / "model.py").write_text(
        "import numpy as np\n\nimport rsrv\n\n\n"
        "class Scale:\n"
        "    def __call__(self, y):\n"
        "        if not y.size:\n"
        "            raise ValueError('empty')\n"
        "        return y * 2\n\n\n"
        'post = rsrv.postprocess(inputs=["y"], outputs=["y"])(Scale())\n'
    )
    hook = load_bundle(tiny_bundle).hooks.postprocess
    y = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(hook.run("m", {"y": y})["y"], y * 2)
    with pytest.raises(Internal, match="^model 'm': postprocess hook 'Scale' failed: ValueError"):
        hook.run("m", {"y": y[:0]})


def test_hook_naming_unknown_tensor(tiny_bundle):
    edit(
        tiny_bundle,
        lambda d: d.update(client_outputs=[{"name": "label", "dtype": "i64", "shape": "n"}]),
    )
    (tiny_bundle / "model.py").write_text(GRADE_MODEL_PY.replace("{input}", "logits"))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.py: @rsrv.postprocess 'label' inputs names 'logits', which is not "
        "one of the executable_outputs (y)"
    )


def test_hook_binding_known_tensor_loads(tiny_bundle):
    edit(
        tiny_bundle,
        lambda d: d.update(client_outputs=[{"name": "label", "dtype": "i64", "shape": "n"}]),
    )
    (tiny_bundle / "model.py").write_text(GRADE_MODEL_PY.replace("{input}", "y"))
    b = load_bundle(tiny_bundle)
    hook = b.hooks.postprocess
    assert (hook.inputs, hook.outputs) == (("y",), ("label",))
    got = hook.apply({"y": np.array([[0.0, 1.0], [2.0, 1.0]], np.float32)})
    np.testing.assert_array_equal(got["label"], [1, 0])
    assert [t.describe() for t in b.signature.client_outputs] == ["label: i64[n]"]


def test_client_output_not_produced(tiny_bundle):
    edit(
        tiny_bundle,
        lambda d: d.update(client_outputs=[{"name": "label", "dtype": "i64", "shape": "n"}]),
    )
    (tiny_bundle / "model.py").write_text("import rsrv\n")
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.py: client output 'label' is neither produced by "
        "@rsrv.postprocess nor passed through under the same name"
    )


@pytest.mark.parametrize(
    ("shape", "dims", "executable_f", "client"),
    [
        ("nf", {"f": 3}, 3, None),
        ("nf", {"f": -1}, 3, None),  # variable: narrowed to what the module takes
        ("nf", {"f": -1}, -1, None),  # ... on both sides alike
        ("nf", {"f": 5}, 3, "x: f32[n,5]"),
        ("nf", {"f": 5}, -1, "x: f32[n,5]"),  # (the module's 3 fixes the executable's)
        ("fn", {"f": 3}, 3, "x: f32[3,n]"),
        ("n", {}, 3, "x: f32[n]"),
    ],
)
def test_a_client_input_passing_through_must_fit_the_executable_input(
    tiny_bundle, shape, dims, executable_f, client
):
    """No preprocess: the client's ``x`` is the executable's, so a shape the module
    cannot take is refused at load (it failed each request INTERNAL in the runtime),
    and a variable extent takes the module's, checked at decoding."""
    x = {"name": "x", "dtype": "f32", "shape": shape, "dims": dims}
    label = {"name": "label", "dtype": "i64", "shape": "n"}

    def change(doc):
        doc["executable_inputs"][0]["dims"]["f"] = executable_f
        doc.update(client_inputs=[x], client_outputs=[label])

    edit(tiny_bundle, change)
    (tiny_bundle / "model.py").write_text(GRADE_MODEL_PY.replace("{input}", "y"))
    if client is None:
        assert load_bundle(tiny_bundle).signature.client_inputs[0].describe() == "x: f32[n,3]"
        return
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/model.py: executable input 'x' passes through unchanged but its "
        f"shape differs ({client} vs x: f32[n,3]): give it the same batch axis and the "
        "extents the other fixes"
    )


def test_client_inputs_without_model_py(tiny_bundle):
    edit(tiny_bundle, lambda d: d.update(client_inputs=d["executable_inputs"]))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: client_inputs: only valid when model.py transforms I/O, "
        "and tiny has no model.py"
    )


def test_loading_model_py_writes_nothing_into_the_bundle(tiny_bundle, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    edit(
        tiny_bundle,
        lambda d: d.update(client_outputs=[{"name": "label", "dtype": "i64", "shape": "n"}]),
    )
    (tiny_bundle / "model.py").write_text(GRADE_MODEL_PY.replace("{input}", "y"))
    before = sorted(p.name for p in tiny_bundle.iterdir())
    load_bundle(tiny_bundle)
    assert sorted(p.name for p in tiny_bundle.iterdir()) == before


# -- meta bundles ----------------------------------------------------------------------------


def test_meta_bundle_loads(tmp_path):
    b = load_bundle(write_meta(tmp_path, META_MANIFEST))
    assert b.kind == "meta" and b.modules == {} and b.weights is None
    assert b.signature.calls == ("tiny",) and b.hooks.meta.outputs == ("y",)


@pytest.mark.parametrize("stray", ["model.b4.mlir", "model.mlir", "weights.safetensors"])
def test_meta_with_a_module_or_weights_file(tmp_path, stray):
    bundle = write_meta(tmp_path, META_MANIFEST)
    (bundle / stray).write_bytes(b"left over")
    assert error(bundle) == (
        f"{bundle}/{stray}: a meta bundle has no modules and no weights file (it calls other "
        "models); remove it"
    )


def test_meta_without_model_py(tmp_path):
    bundle = write_meta(tmp_path, META_MANIFEST, model_py=None)
    assert error(bundle) == (
        f"{bundle}/manifest.yaml: kind: a meta bundle needs a model.py declaring @rsrv.meta, "
        "and ensemble has no model.py"
    )


@pytest.mark.parametrize("missing", ["client_inputs", "client_outputs"])
def test_meta_missing_client_io(tmp_path, missing):
    manifest = {k: v for k, v in META_MANIFEST.items() if k != missing}
    bundle = write_meta(tmp_path, manifest)
    assert error(bundle) == (
        f"{bundle}/manifest.yaml: kind: a meta bundle must declare client_inputs and client_outputs"
    )


def test_meta_calls_itself(tmp_path):
    bundle = write_meta(tmp_path, {**META_MANIFEST, "meta": {"calls": ["tiny", "ensemble"]}})
    assert error(bundle) == (
        f"{bundle}/manifest.yaml: meta.calls: a meta model may not call itself ('ensemble')"
    )


def test_meta_duplicate_calls(tmp_path):
    bundle = write_meta(tmp_path, {**META_MANIFEST, "meta": {"calls": ["tiny", "tiny"]}})
    assert error(bundle) == f"{bundle}/manifest.yaml: meta.calls: duplicate model(s) tiny"


@pytest.mark.parametrize("meta", [None, {}, {"calls": []}])
def test_meta_without_calls(tmp_path, meta):
    manifest = {k: v for k, v in META_MANIFEST.items() if k != "meta"}
    if meta is not None:
        manifest["meta"] = meta
    bundle = write_meta(tmp_path, manifest)
    assert error(bundle) == (
        f"{bundle}/manifest.yaml: meta: a meta bundle must declare meta.calls (the models it calls)"
    )


def test_meta_with_executable_tensors(tmp_path):
    manifest = {**META_MANIFEST, "executable_inputs": META_MANIFEST["client_inputs"]}
    bundle = write_meta(tmp_path, manifest)
    assert error(bundle) == (
        f"{bundle}/manifest.yaml: kind: a meta bundle has no executable_inputs, "
        "executable_outputs or batching (it runs no module of its own)"
    )


def test_meta_hook_not_producing_client_output(tmp_path):
    manifest = {
        **META_MANIFEST,
        "client_outputs": [
            *META_MANIFEST["client_outputs"],
            {"name": "z", "dtype": "f32", "shape": "n"},
        ],
    }
    bundle = write_meta(tmp_path, manifest)
    assert error(bundle) == f"{bundle}/model.py: @rsrv.meta does not produce client output(s) z"


def test_meta_calls_on_a_model(tiny_bundle):
    edit(tiny_bundle, lambda d: d.update(meta={"calls": ["other"]}))
    assert error(tiny_bundle) == (
        f"{tiny_bundle}/manifest.yaml: meta: only a meta bundle (kind: meta) may declare meta.calls"
    )


# -- equivalences ----------------------------------------------------------------------------


def test_yaml_and_toml_manifests_load_the_same(tiny_bundle):
    from_yaml = load_bundle(tiny_bundle)
    (tiny_bundle / "manifest.yaml").unlink()
    (tiny_bundle / "manifest.toml").write_text(TINY_TOML)
    from_toml = load_bundle(tiny_bundle)
    assert from_toml.manifest_path.name == "manifest.toml"
    assert from_toml.signature == from_yaml.signature
    # TINY_TOML carries no provenance; everything else must be identical
    without = {"provenance": {}}
    assert msgspec.structs.replace(from_toml.manifest, **without) == msgspec.structs.replace(
        from_yaml.manifest, **without
    )


def spec_examples(repo_root: Path) -> dict[tuple[str, str], str]:
    """The code blocks of specs/bundle.md whose first line is ``# <something>-example``."""
    text = (repo_root / "specs" / "bundle.md").read_text()
    return {
        (lang, marker): body
        for lang, marker, body in re.findall(r"```(\w+)\n# ([\w-]+-example)\n(.*?)```", text, re.S)
    }


def test_spec_yaml_and_toml_examples_agree(repo_root, tmp_path):
    """specs/bundle.md shows one manifest in YAML and in TOML: both parse to the same thing."""
    blocks = spec_examples(repo_root)
    resolved = []
    for ext in ("yaml", "toml"):
        path = tmp_path / ext / "severity_grader" / f"manifest.{ext}"
        path.parent.mkdir(parents=True)
        path.write_text(blocks[ext, "manifest-example"])
        manifest = decode_manifest(path)
        assert isinstance(manifest, Manifest)
        resolved.append((manifest, resolve_manifest(manifest, path)))
    assert resolved[0] == resolved[1]


def test_spec_examples_load_as_bundles(repo_root, examples_dir, tmp_path):
    """The spec's manifest + model.py, with the example grader's modules, is a valid bundle;
    the spec's meta example is a valid meta bundle."""
    blocks = spec_examples(repo_root)
    bundle = Path(shutil.copytree(examples_dir / "severity_grader", tmp_path / "grader"))
    (bundle / "manifest.yaml").write_text(blocks["yaml", "manifest-example"])
    (bundle / "model.py").write_text(blocks["python", "model-example"])
    b = load_bundle(bundle)
    assert [t.describe() for t in b.signature.client_inputs] == ["photo: u8[n,?,?,3]"]
    photo = np.zeros((2, 50, 70, 3), np.uint8)
    image = b.hooks.preprocess.apply({"photo": photo})["image"]
    assert image.shape == (2, 32, 32, 3) and image.dtype == np.uint8
    grade = b.hooks.postprocess.apply({"logits": np.array([[1, -1, 1, 1, 1, 1]], np.float32)})
    assert grade["grade"].tolist() == [1]

    meta = write_meta(
        tmp_path,
        msgspec.yaml.decode(blocks["yaml", "meta-example"].encode()),
        blocks["python", "meta-model-example"],
        name="grade_and_label",
    )
    m = load_bundle(meta)
    assert m.signature.calls == ("severity_grader", "classifier")

    def call(model, tensors):
        assert model in m.signature.calls
        if model == "severity_grader":
            return {"grade": np.full(len(tensors["image"]), 3, np.int64)}
        return {"logits": np.eye(10, dtype=np.float32)[[4] * len(tensors["x"])]}

    out = m.hooks.meta.apply({"image": np.zeros((2, 32, 32, 3), np.uint8)}, call)
    assert out["grade"].tolist() == [3, 3] and out["label"].tolist() == [4, 4]


def _export_text(x_shape: tuple[int, ...]) -> str:
    """The tiny model as jax.export's StableHLO text: main(x, b, w) in argument_order."""

    def entry(x, b, w):
        return (x @ w + b,)

    f32 = np.float32
    exported = jax.export.export(jax.jit(entry))(
        jax.ShapeDtypeStruct(x_shape, f32),
        jax.ShapeDtypeStruct((2,), f32),
        jax.ShapeDtypeStruct((3, 2), f32),
    )
    return exported.mlir_module()


def test_text_and_bytecode_modules_load_and_run_the_same(tiny_bundle, tmp_path):
    text_bundle = Path(shutil.copytree(tiny_bundle, tmp_path / "text" / "tiny"))
    for n in (1, 2):
        (text_bundle / f"model.b{n}.mlir").write_text(_export_text((n, 3)))
    assert isinstance(read_module(text_bundle / "model.b1.mlir"), str)
    assert isinstance(read_module(tiny_bundle / "model.b1.mlir"), bytes)

    compiler = Compiler()
    weights = tiny_weights(tiny_bundle)
    rng = np.random.default_rng(7)
    xs = {n: rng.standard_normal((n, 3)).astype(np.float32) for n in (1, 2)}
    results = {}
    for bundle in (tiny_bundle, text_bundle):
        b = load_bundle(bundle)
        model = compile_bundle(b, compiler)
        dev_weights = weights_to_device(b)
        results[bundle] = {n: model.run(n, [xs[n]], dev_weights)[0] for n in (1, 2)}
    for n in (1, 2):
        np.testing.assert_array_equal(results[tiny_bundle][n], results[text_bundle][n])
        np.testing.assert_allclose(
            results[tiny_bundle][n], xs[n] @ weights["w"] + weights["b"], rtol=1e-6, atol=1e-6
        )


# -- repositories and `rsrv bundle check` ----------------------------------------------------


def test_broken_bundle_does_not_stop_the_others(tiny_bundle):
    repo = tiny_bundle.parent
    broken = Path(shutil.copytree(tiny_bundle, repo / "broken"))
    (broken / "weights.safetensors").unlink()
    write_meta(repo, META_MANIFEST)
    (repo / "notes").mkdir()  # a directory without a manifest is not a bundle
    found = scan(repo)
    assert sorted(found) == ["broken", "ensemble", "tiny"]
    assert isinstance(found["tiny"], Bundle) and isinstance(found["ensemble"], Bundle)
    assert isinstance(found["broken"], BundleError)
    assert str(found["broken"]) == (
        f"{broken}/weights.safetensors: missing (every model bundle has a weights file)"
    )


def test_model_directory_layouts(tiny_bundle):
    """A bundle directly in a model directory is version 1; otherwise its versions are
    the numbered directories holding a manifest; both at once is an error."""
    repo = tiny_bundle.parent
    assert model_versions(tiny_bundle) == {1: tiny_bundle}
    versioned = repo / "versioned"
    for number in ("3", "1", "12"):
        shutil.copytree(tiny_bundle, versioned / number)
    (versioned / "7").mkdir()  # no manifest: not a version
    shutil.copytree(tiny_bundle, versioned / "05")  # not a version number: ignored
    shutil.copytree(tiny_bundle, versioned / "latest")
    assert model_versions(versioned) == {n: versioned / str(n) for n in (1, 3, 12)}
    loaded = load_bundle(versioned / "3", "versioned")
    assert loaded.name == "versioned" and loaded.path == versioned / "3"
    assert sorted(p.name for p in discover(repo)) == ["tiny", "versioned"]
    assert isinstance(scan(repo)["versioned"], Bundle)

    shutil.copytree(tiny_bundle, tiny_bundle / "2")
    with pytest.raises(BundleError) as info:
        model_versions(tiny_bundle)
    assert str(info.value) == (
        f"{tiny_bundle}: a manifest directly in the model directory makes it version 1, but "
        "it also holds version directories (2); keep one layout"
    )


def test_version_policy_comes_from_the_newest_manifest(tiny_bundle):
    model = tiny_bundle.parent / "m"
    for number in (1, 2):
        shutil.copytree(tiny_bundle, model / str(number))
    versions = model_versions(model)
    assert version_policy_of(versions) is None
    manifest = model / "2" / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "version_policy: {latest: 2}\n")
    assert version_policy_of(versions) == VersionPolicy(latest=2)
    manifest.write_text(
        (model / "1" / "manifest.yaml").read_text() + "version_policy: {latest: 1, all: true}\n"
    )
    assert version_policy_of(versions) is None  # unreadable: loading version 2 says why
    with pytest.raises(BundleError) as info:
        load_bundle(model / "2", "m")
    assert str(info.value) == (
        f"{model}/2/manifest.yaml: version_policy: a version policy is one of latest, all or "
        "specific, got latest and all"
    )


def test_check_examples(examples_dir):
    out = io.StringIO()
    assert check_main([examples_dir], out=out) == 0
    text = out.getvalue()
    for line in [
        f"OK   classifier (model)  {examples_dir / 'classifier'}",
        "  inputs:  x: f32[n,256]",
        "  outputs: logits: f32[n,10]",
        "  weights: 4 tensors, 66.8 KiB",
        f"OK   severity_grader (model)  {examples_dir / 'severity_grader'}",
        "  inputs:  image: u8[n,32,32,3]",
        "  outputs: grade: i64[n]",
        "  weights: 7 tensors, 1.5 KiB",
        "  model.py: postprocess grade",
        "5 ok, 0 failed",
    ]:
        assert line in text.splitlines(), line
    assert (
        len(re.findall(r"^  batch sizes: 1, 4, 8  \(compiled in \d+\.\d\d s\)$", text, re.M)) == 2
    )


def test_check_broken(tiny_bundle):
    repo = tiny_bundle.parent
    broken = Path(shutil.copytree(tiny_bundle, repo / "broken"))
    edit(broken, lambda d: d["executable_inputs"][0].update(shape="nhw", dims={"h": 3}))
    out = io.StringIO()
    assert check_main([repo], out=out) == 1
    text = out.getvalue()
    assert (
        f"FAIL broken\n  {broken}/manifest.yaml: executable_inputs[0].dims: letter 'w' of "
        "shape 'nhw' has no size\n"
    ) in text
    assert "OK   tiny (model)" in text
    assert text.endswith("1 ok, 1 failed\n")
    # A bundle directory given directly is checked as one bundle.
    out = io.StringIO()
    assert check_main([tiny_bundle], out=out) == 0
    assert out.getvalue().endswith("1 ok, 0 failed\n")


def test_check_fails_a_path_with_nothing_to_check(tmp_path):
    """A mistyped path, or an empty directory, passed as "0 ok, 0 failed" (exit 0)."""
    missing, empty = tmp_path / "bundels", tmp_path / "empty"
    empty.mkdir()
    out = io.StringIO()
    assert check_main([missing, empty], out=out) == 1
    text = out.getvalue()
    assert f"FAIL bundels\n  {missing}: no such file or directory\n" in text
    assert f"FAIL empty\n  {empty}: no bundle, model or repository here\n" in text
    assert text.endswith("0 ok, 2 failed\n")


def _rsrv_command() -> list[str]:
    script = Path(sys.executable).parent / "rsrv"
    found = script if script.is_file() else shutil.which("rsrv")
    assert found, "the rsrv console script is not installed (pip install -e .)"
    return [str(found)]


def test_check_console_script(repo_root, tiny_bundle):
    ok = subprocess.run(
        [*_rsrv_command(), "bundle", "check", "bundles"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK   classifier (model)" in ok.stdout and "OK   severity_grader (model)" in ok.stdout
    assert ok.stdout.endswith("5 ok, 0 failed\n")

    (tiny_bundle / "weights.safetensors").unlink()
    bad = subprocess.run(
        [*_rsrv_command(), "bundle", "check", str(tiny_bundle)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert f"{tiny_bundle}/weights.safetensors: missing" in bad.stdout


def test_check_piped_into_a_reader_that_stops_is_quiet(repo_root):
    """`rsrv bundle check bundles | head -1`: the rest has nowhere to go, and no
    BrokenPipeError traceback says so."""
    with subprocess.Popen(
        [*_rsrv_command(), "bundle", "check", "bundles"],
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as check:
        assert check.stdout.readline().startswith(b"OK   ")
        check.stdout.close()  # (head exits)
        error = check.stderr.read()
        assert check.wait(timeout=120) == 1
    assert b"Traceback" not in error and b"BrokenPipeError" not in error
