"""``rsrv.export`` adapters, gates, provenance, determinism and the CLI (specs/export.md).

A Flax NNX MLP, an Equinox MLP and a Flax Linen CNN are exported at batch sizes 1, 4 and
8 into one repository and served by a real worker; tritonclient answers must match the
source frameworks. The arity gate refuses lifted RNG state, the parity gate refuses a
bundle that does not compute what the source computes, and neither writes anything.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
import tritonclient.grpc as tc
from flax import linen, nnx
from safetensors import safe_open
from support import ROOT
from support.clients import connect
from support.serving import running, worker_config

from rsrv.bundle import load_bundle
from rsrv.cli import main as cli_main
from rsrv.export import (
    ExportError,
    ExportSpec,
    Input,
    Output,
    Parity,
    collect_provenance,
    export_equinox,
    export_flax_linen,
    export_flax_nnx,
    export_jax,
    export_model,
    framework_of,
)
from rsrv.export._parity import TOLERANCES

SIZES = [1, 4, 8]
# a fixed provenance: byte-comparable manifests
FIXED = {"source": "tests/unit/export/test_export.py"}


def f32():
    """Build models with 32-bit defaults: the runtime turns jax_enable_x64 on process-wide
    (Equinox, for one, then initialises float64 weights)."""
    return jax.enable_x64(False)


def manifest(bundle: Path) -> dict:
    return msgspec.yaml.decode((bundle / "manifest.yaml").read_bytes())


def argument_order(bundle: Path) -> list[str]:
    with safe_open(str(bundle / "weights.safetensors"), "np") as f:
        return json.loads(f.metadata()["argument_order"])


def listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# -- the three models ----------------------------------------------------------------------


class NnxMLP(nnx.Module):
    """16 features -> 5 logits, with BatchNorm (running stats: weights) and Dropout (RNG
    state: unused in eval mode, so dropped)."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def nnx_mlp() -> NnxMLP:
    with f32():
        model = nnx.jit(lambda: NnxMLP(nnx.Rngs(0)))()
        # running statistics that are not the identity, so they visibly matter
        model.norm.mean[...] = jnp.linspace(-0.5, 0.5, 32)
        model.norm.var[...] = jnp.linspace(0.5, 2.0, 32)
    return model


def eqx_mlp() -> eqx.nn.MLP:
    with f32():
        return eqx.filter_jit(lambda: eqx.nn.MLP(16, 5, 32, 2, key=jax.random.key(1)))()


class LinenCNN(linen.Module):
    """u8 8x8 RGB image -> 3 logits: conv, BatchNorm, global mean, dense."""

    @linen.compact
    def __call__(self, image, train: bool = False):
        x = image.astype(jnp.float32) / 255.0
        x = linen.Conv(8, (3, 3))(x)
        x = linen.BatchNorm(use_running_average=not train)(x)
        x = linen.relu(x).mean(axis=(1, 2))
        return linen.Dense(3)(x)


def linen_cnn() -> tuple[LinenCNN, dict]:
    model = LinenCNN()
    with f32():
        variables = jax.jit(model.init)(jax.random.key(2), jnp.zeros((1, 8, 8, 3), jnp.uint8))
    return model, variables


X16 = [Input("x", np.float32, ("n", 16), letters="nf")]
IMAGE = [Input("image", np.uint8, ("n", 8, 8, 3), letters="nhwc")]


@pytest.fixture(scope="module")
def models():
    return {"nnx_mlp": nnx_mlp(), "eqx_mlp": eqx_mlp(), "linen_cnn": linen_cnn()}


@pytest.fixture(scope="module")
def repo(models, tmp_path_factory) -> Path:
    """The three models exported; the parity gate's executables are kept in
    ``repo/../cache``, which the serving test's worker then uses."""
    repo = tmp_path_factory.mktemp("export") / "repo"
    gate = Parity(cache_dir=repo.parent / "cache")
    export_flax_nnx(
        models["nnx_mlp"],
        inputs=X16,
        outputs=[Output("logits", letters="nk")],
        batch_sizes=SIZES,
        out_dir=repo / "nnx_mlp",
        parity=gate,
    )
    export_equinox(
        models["eqx_mlp"],
        inputs=X16,
        outputs=["logits"],
        batch_sizes=SIZES,
        out_dir=repo / "eqx_mlp",
        parity=gate,
    )
    model, variables = models["linen_cnn"]
    export_flax_linen(
        model,
        variables,
        apply_kwargs={"train": False},
        inputs=IMAGE,
        outputs=[Output("logits", letters="nk")],
        batch_sizes=SIZES,
        out_dir=repo / "linen_cnn",
        parity=gate,
    )
    return repo


def source_outputs(models, name: str, x: np.ndarray) -> np.ndarray:
    """What the source framework computes, called the framework's own way."""
    with f32():
        if name == "nnx_mlp":
            model = nnx.clone(models[name])
            model.eval()
            return np.asarray(model(jnp.asarray(x)))
        if name == "eqx_mlp":
            model = eqx.nn.inference_mode(models[name])
            return np.asarray(jax.vmap(model)(jnp.asarray(x)))
        model, variables = models[name]
        return np.asarray(model.apply(variables, jnp.asarray(x), train=False))


def test_exported_bundles_layout_and_weight_names(repo):
    assert listing(repo) == ["eqx_mlp", "linen_cnn", "nnx_mlp"]  # no staging left behind
    for name in listing(repo):
        assert listing(repo / name) == [
            "manifest.yaml",
            "model.b1.mlir",
            "model.b4.mlir",
            "model.b8.mlir",
            "weights.safetensors",
        ]
        assert load_bundle(repo / name).batch_sizes == (1, 4, 8)
    # NNX: params and batch stats by path; the Dropout's RNG state is not a weight
    assert argument_order(repo / "nnx_mlp") == [
        "hidden.bias",
        "hidden.kernel",
        "norm.bias",
        "norm.mean",
        "norm.scale",
        "norm.var",
        "out.bias",
        "out.kernel",
    ]
    # Equinox: the array leaves of eqx.partition, by path, in pytree order
    assert argument_order(repo / "eqx_mlp") == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
        "layers.2.weight",
        "layers.2.bias",
    ]
    # Linen: every collection of the variables, the collection first
    assert argument_order(repo / "linen_cnn") == [
        "batch_stats.BatchNorm_0.mean",
        "batch_stats.BatchNorm_0.var",
        "params.BatchNorm_0.bias",
        "params.BatchNorm_0.scale",
        "params.Conv_0.bias",
        "params.Conv_0.kernel",
        "params.Dense_0.bias",
        "params.Dense_0.kernel",
    ]
    doc = manifest(repo / "linen_cnn")
    assert doc["executable_inputs"] == [
        {"name": "image", "dtype": "u8", "shape": "nhwc", "dims": {"h": 8, "w": 8, "c": 3}}
    ]
    assert doc["executable_outputs"] == [
        {"name": "logits", "dtype": "f32", "shape": "nk", "dims": {"k": 3}}
    ]
    assert doc["provenance"]["framework"] == "flax.linen"
    assert manifest(repo / "nnx_mlp")["provenance"]["framework"] == "flax.nnx"
    assert manifest(repo / "eqx_mlp")["provenance"]["versions"]["equinox"] == metadata.version(
        "equinox"
    )


def test_served_by_a_worker_through_tritonclient(repo, models):
    rng = np.random.default_rng(7)
    cache = repo.parent / "cache"
    assert len(list((cache / "executables").iterdir())) == 9  # 3 models x 3 batch sizes
    with (
        running(worker_config(repo, cache, MODEL_CONTROL_MODE="static")) as w,
        connect(w) as client,
    ):
        for name in ("nnx_mlp", "eqx_mlp", "linen_cnn"):
            for rows in (1, 3, 8):  # 3 is padded up to the compiled size 4
                if name == "linen_cnn":
                    x = rng.integers(0, 256, (rows, 8, 8, 3)).astype(np.uint8)
                    tensor = tc.InferInput("image", list(x.shape), "UINT8")
                else:
                    x = rng.standard_normal((rows, 16)).astype(np.float32)
                    tensor = tc.InferInput("x", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                got = client.infer(name, [tensor]).as_numpy("logits")
                np.testing.assert_allclose(
                    got,
                    source_outputs(models, name, x),
                    rtol=1e-4,
                    atol=1e-5,
                    err_msg=f"{name} rows={rows}",
                )


# -- the arity gate ------------------------------------------------------------------------


class NoisyMLP(nnx.Module):
    """A stochastic layer: adds Gaussian noise drawn from its own RNG stream on every call,
    in eval mode too. Exporting it would need the RNG key and counter as arguments."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        y = self.linear(x)
        return y + 0.1 * jax.random.normal(self.rngs.noise(), y.shape)


def test_arity_gate_refuses_lifted_rng_state_and_writes_nothing(tmp_path):
    with f32():
        model = NoisyMLP(nnx.Rngs(0, noise=1))
    with pytest.raises(ExportError) as info:
        export_flax_nnx(
            model,
            inputs=[Input("x", np.float32, ("n", 4))],
            outputs=["y"],
            batch_sizes=[1, 2],
            out_dir=tmp_path / "noisy",
        )
    message = str(info.value)
    assert message.startswith(
        "UNSERVABLE: the compiled entry takes 5 arguments but rsrv calls it with 3 "
        "(1 inputs + 2 weights). The likely cause is state lifted into extra arguments"
    )
    assert "Lifted here: rngs.noise.count (nnx.RngCount), rngs.noise.key (nnx.RngKey)" in message
    assert "draws random numbers" in message
    assert listing(tmp_path) == []  # no bundle, no staging directory


def test_dropout_in_training_mode_is_lifted_state_too(tmp_path):
    with f32():
        model = nnx_mlp()
    with pytest.raises(ExportError, match=r"Lifted here: drop\.rngs\.count"):
        export_flax_nnx(
            model,
            eval=False,
            inputs=X16,
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "train",
        )
    assert listing(tmp_path) == []
    assert model.drop.deterministic is False  # eval=True would have worked on a copy


def test_prng_key_parameters_are_refused(tmp_path):
    with pytest.raises(ExportError, match=r"^weight 'key' is a PRNG key \(key<fry>\)"):
        export_jax(
            lambda p, x: x,
            {"key": jax.random.key(0)},
            inputs=[Input("x", np.float32, ("n", 2))],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "k",
        )
    assert listing(tmp_path) == []


# -- the parity gate -----------------------------------------------------------------------


def test_parity_gate_removes_a_bundle_that_differs(models, tmp_path, monkeypatch, caplog):
    """The weights written to disk are perturbed: the served module differs from the source."""
    import safetensors.numpy

    real_save = safetensors.numpy.save_file

    def tampered(tensors, path, metadata=None):
        tensors = dict(tensors)
        tensors["out.bias"] = tensors["out.bias"] + np.float32(0.01)
        return real_save(tensors, path, metadata=metadata)

    out = tmp_path / "nnx_mlp"
    export_flax_nnx(
        models["nnx_mlp"],
        inputs=X16,
        outputs=["logits"],
        batch_sizes=[1, 2],
        out_dir=out,
        provenance=FIXED,
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(safetensors.numpy, "save_file", tampered)
    with pytest.raises(ExportError) as info:
        export_flax_nnx(
            models["nnx_mlp"],
            inputs=X16,
            outputs=["logits"],
            batch_sizes=[1, 2, 4],
            out_dir=out,
            provenance=FIXED,
        )
    message = str(info.value)
    assert message.startswith(
        "PARITY: output 'logits' at batch size 4 differs from the "
        "source framework: 20 of 20 elements are not equal within "
        "rtol 0.0001, atol 1e-05; max abs err 0.01"
    )
    assert message.endswith("Nothing was written.")
    assert listing(tmp_path) == ["nnx_mlp"]  # the staged bundle is gone ...
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # ... the old one kept

    monkeypatch.setattr(safetensors.numpy, "save_file", real_save)
    caplog.set_level("INFO", logger="rsrv.export")
    export_flax_nnx(
        models["nnx_mlp"],
        inputs=X16,
        outputs=["logits"],
        batch_sizes=[1, 2, 4],
        out_dir=tmp_path / "fresh",
        provenance=FIXED,
    )
    assert any(
        r.getMessage().startswith("fresh: parity ok at batch sizes 1, 2, 4: max abs err ")
        for r in caplog.records
    )


def test_parity_gate_on_a_fresh_directory_writes_nothing(tmp_path):
    def shifty(p, x):  # traced for the bundle: one answer; run eagerly ... the same, but:
        return x @ p["w"]

    def wrong_reference(p, x):
        return x @ p["w"] + 1.0

    from rsrv.export import Program, export_program

    w = np.eye(3, dtype=np.float32)
    program = Program(
        lambda ws, _s, x: shifty({"w": ws[0]}, x),
        ["w"],
        [w],
        reference=lambda x: wrong_reference({"w": w}, x),
    )
    export = functools.partial(
        export_program,
        program,
        inputs=[Input("x", np.float32, ("n", 3))],
        outputs=["y"],
        batch_sizes=[1, 2],
        out_dir=tmp_path / "m",
    )
    with pytest.raises(ExportError, match="^PARITY: output 'y' at batch size 2 differs"):
        export()
    assert listing(tmp_path) == []
    export(parity=False)  # parity=False skips the gate
    assert listing(tmp_path) == ["m"]


@pytest.mark.parametrize("sizes", [[1, 4], [4]])
def test_parity_gate_catches_rows_that_depend_on_the_batch(tmp_path, sizes):
    """BatchNorm on batch statistics (training mode): the source agrees with the bundle at
    every size, but a row's answer depends on the other rows, which batching breaks: a
    row run alone, padded with zero rows as the server pads it, answers otherwise. With
    one compiled size too (no smaller size to compare with)."""

    class Norm(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.linear(x))

    with f32():
        model = Norm(nnx.Rngs(0))
    with pytest.raises(ExportError) as info:
        export_flax_nnx(
            model,
            eval=False,
            inputs=[Input("x", np.float32, ("n", 4))],
            outputs=["y"],
            batch_sizes=sizes,
            out_dir=tmp_path / "bn",
        )
    assert str(info.value).startswith(
        "PARITY: output 'y' at batch size 4 differs from the "
        "source framework (row 0 of the same batch of 4)"
    )
    assert "the other rows zero as the server pads them" in str(info.value)
    assert "Rows are not computed independently" in str(info.value)
    assert listing(tmp_path) == []


@pytest.mark.parametrize(
    ("fn", "caught"),
    [
        # (row 0 alone answers as in the batch: the first row's check passed these)
        (lambda p, x: jnp.cumsum(x, axis=0) * p["w"], "row 3 of the same batch of 4"),
        (lambda p, x: x - x[:1] + p["w"], "row 3 of the same batch of 4"),
        (lambda p, x: x + jnp.arange(x.shape[0])[:, None] * p["w"], "in reverse order"),
    ],
)
def test_parity_gate_catches_rows_that_depend_on_earlier_rows(tmp_path, fn, caught):
    """A row's answer that depends on the rows before it, or on where it sits in the
    batch: served, a request's rows sit anywhere in a batch, beside other requests'
    (these exported, and one client's rows changed the answers of another). Refused,
    it leaves nothing, not even the parents of ``out_dir`` it made (they were left)."""
    with pytest.raises(ExportError, match=re.escape(caught)):
        export_jax(
            fn,
            {"w": np.float32(2.0)},
            inputs=[Input("x", np.float32, ("n", 3))],
            outputs=["y"],
            batch_sizes=[4],
            out_dir=tmp_path / "new" / "repo" / "m",
        )
    assert listing(tmp_path) == []


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_parity_tolerance_follows_a_low_precision_output(tmp_path, dtype, caplog):
    """The same rows at two batch sizes differ in their last bits in bf16 and f16 (jax
    itself answers so): with f32's tolerance the gate refused such a model, blaming
    batching; an explicit tolerance still applies to every output."""
    caplog.set_level("INFO", logger="rsrv.export")
    rng = np.random.default_rng(0)
    d = 512
    params = {k: (rng.standard_normal((d, d)) / np.sqrt(d)).astype(dtype) for k in "ab"}
    options = dict(inputs=[Input("x", dtype, ("n", d))], outputs=["y"], batch_sizes=[1, 4, 16, 64])

    def mlp(p, x):
        return jax.nn.gelu(x @ p["a"]) @ p["b"]

    export_jax(mlp, params, out_dir=tmp_path / "m", **options)
    rtol, atol = TOLERANCES[np.dtype(dtype).name]
    assert any(f"(rtol {rtol:g}, atol {atol:g})" in r.getMessage() for r in caplog.records)
    with pytest.raises(ExportError, match="within rtol 0.0001, atol 1e-05"):
        export_jax(mlp, params, out_dir=tmp_path / "n", parity=Parity(1e-4, 1e-5), **options)


def test_parity_make_inputs_of_another_dtype_or_shape_is_refused(tmp_path):
    """It ran, and failed with the runtime's own error (JaxRuntimeError: ... f64[2,3])."""
    options = dict(
        inputs=[Input("x", np.float32, ("n", 3))],
        outputs=["y"],
        batch_sizes=[2],
        out_dir=tmp_path / "m",
    )
    made = Parity(make_inputs=lambda n: [np.random.default_rng(0).standard_normal((n, 3))])
    with pytest.raises(
        ExportError,
        match=r"returned float64\[2, 3\] for input 'x', which is "
        r"float32\[2, 3\]",
    ):
        export_jax(lambda p, x: x * 2, {}, parity=made, **options)
    made = Parity(make_inputs=lambda n: [])
    with pytest.raises(ExportError, match=r"make_inputs\(2\) returned 0 arrays for 1 inputs"):
        export_jax(lambda p, x: x * 2, {}, parity=made, **options)


def test_a_python_int_past_int32_is_refused_as_a_weight(tmp_path):
    """(The gate's reference converted it first: a bare OverflowError.)"""
    with pytest.raises(ExportError, match="weight 'big' is not an array: int"):
        export_jax(
            lambda p, x: x,
            {"big": 2**40},
            inputs=[Input("x", np.float32, ("n", 3))],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "m",
        )


def test_a_python_number_weight_passes_the_gate_with_a_low_precision_input(tmp_path):
    """The number is an f32 weight (specs/export.md section 2): the gate's reference ran
    it weakly typed (bf16 out), so such a model was always refused."""
    out = export_jax(
        lambda p, x: x * p["s"],
        {"s": 2.0},
        inputs=[Input("x", jnp.bfloat16, ("n", 3))],
        outputs=["y"],
        batch_sizes=[2],
        out_dir=tmp_path / "m",
    )
    assert manifest(out)["executable_outputs"][0]["dtype"] == "f32"


def test_parity_gate_compares_smaller_sizes_with_the_same_rows_of_the_largest(tmp_path):
    """A row's answer that depends on the batch size, not on the other rows, passes the
    padded check at each size; a smaller size's rows still differ from the same rows in
    a batch of the largest size."""

    def fn(p, x):
        return x * x.shape[0]

    with pytest.raises(ExportError) as info:
        export_jax(
            fn,
            {},
            inputs=[Input("x", np.float32, ("n", 3))],
            outputs=["y"],
            batch_sizes=[1, 4],
            out_dir=tmp_path / "m",
        )
    assert str(info.value).startswith(
        "PARITY: output 'y' at batch size 1 differs from the "
        "source framework (the same rows in a batch of 4)"
    )


def test_parity_integer_outputs_are_exact_and_settings_apply(tmp_path, caplog):
    caplog.set_level("INFO", logger="rsrv.export")
    out = export_jax(
        lambda p, x, ids: (x * p["s"], p["table"][ids]),
        {"s": np.float32(3.0), "table": np.arange(10, dtype=np.int32)},
        inputs=[Input("x", np.float32, ("n", 2)), Input("ids", np.int32, ("n",))],
        outputs=["y", "t"],
        batch_sizes=[3],
        out_dir=tmp_path / "m",
        parity=Parity(rtol=0.0, atol=0.0, seed=5, int_range=(0, 10)),
    )
    assert manifest(out)["executable_outputs"][1]["dtype"] == "i32"
    # the gate compared with exactly the tolerances given (seed and int_range only shape
    # the random inputs, which both sides then agree on)
    assert any("(rtol 0, atol 0)" in r.getMessage() for r in caplog.records)


def test_linear_algebra_exports_and_passes_the_parity_gate(tmp_path):
    """jnp.linalg lowers to LAPACK custom calls that jax marks with Shardy sharding rules,
    which a portable artifact cannot hold: they are dropped (a bundle runs on one device)."""
    a = (np.eye(3) * 2 + 0.1).astype(np.float32)
    out = export_jax(
        lambda p, x: (jnp.linalg.solve(p["a"], x[..., None])[..., 0], x @ jnp.linalg.inv(p["a"])),
        {"a": a},
        inputs=[Input("x", np.float32, ("n", 3))],
        outputs=["y", "z"],
        batch_sizes=[1, 4],
        out_dir=tmp_path / "m",
    )
    assert (out / "model.b4.mlir").read_bytes().startswith(b"ML\xefR")


# -- provenance ----------------------------------------------------------------------------


def tiny(out_dir: Path, **kwargs) -> Path:
    kwargs.setdefault("parity", False)
    return export_jax(
        lambda p, x: x * p["k"],
        {"k": np.float32(2.0)},
        inputs=[Input("x", np.float32, ("n", 2))],
        outputs=["y"],
        batch_sizes=[1],
        out_dir=out_dir,
        **kwargs,
    )


def test_provenance_records_versions_git_and_source_date_epoch(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    monkeypatch.chdir(ROOT)  # inside this repository's work tree
    a, b = tiny(tmp_path / "a"), tiny(tmp_path / "b")
    doc = manifest(a)["provenance"]
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert doc == {
        "framework": "jax",
        "versions": {
            "jax": jax.__version__,
            "jaxlib": metadata.version("jaxlib"),
            "rsrv": metadata.version("rsrv"),
        },
        "git": {"commit": head, "dirty": doc["git"]["dirty"]},
        "exported_at": "2023-11-14T22:13:20Z",
        "jax_enable_x64": False,
    }
    assert isinstance(doc["git"]["dirty"], bool)
    assert (a / "manifest.yaml").read_bytes() == (b / "manifest.yaml").read_bytes()

    monkeypatch.chdir(tmp_path)  # not a git work tree: no git entry
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    doc = manifest(tiny(tmp_path / "c"))["provenance"]
    assert "git" not in doc and doc["exported_at"].endswith("Z")


def test_provenance_override_and_extension(tmp_path, monkeypatch):
    assert manifest(tiny(tmp_path / "a", provenance=FIXED))["provenance"] == FIXED
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    record = collect_provenance("jax", ["numpy"], source="train.py")
    assert record["exported_at"] == "1970-01-01T00:00:00Z" and record["source"] == "train.py"
    assert record["versions"]["numpy"] == np.__version__


def test_bad_source_date_epoch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(ExportError, match="SOURCE_DATE_EPOCH='yesterday' is not a number"):
        tiny(tmp_path / "a")
    assert listing(tmp_path) == []


# -- 64-bit determinism ----------------------------------------------------------------------

X64_MODULE = """
import numpy as np
from rsrv.export import Input, export_jax

def forward(p, x, ids):
    # Traced differently under jax_enable_x64 unless export_jax fixes the setting: with
    # it on, the sum of an int32 array is int64.
    return (x * 0.5 + p["w"]).sum(-1) * 2.0, (ids + 1).sum(-1)

def export(out_dir, **kwargs):
    return export_jax(forward, {"w": np.linspace(0, 1, 3, dtype=np.float32)},
                      inputs=[Input("x", np.float32, ("n", 3)), Input("ids", np.int32, ("n", 2))],
                      outputs=["s", "c"], batch_sizes=[1, 2], out_dir=out_dir,
                      provenance={"source": "x64"}, parity=False, **kwargs)

if __name__ == "__main__":
    import sys
    export(sys.argv[1])
"""


def test_export_bytes_do_not_depend_on_the_process_x64_setting(tmp_path, monkeypatch):
    (tmp_path / "x64mod.py").write_text(X64_MODULE)
    env = {**os.environ, "JAX_ENABLE_X64": "0", "PYTHONPATH": str(tmp_path)}
    subprocess.run(
        [sys.executable, str(tmp_path / "x64mod.py"), str(tmp_path / "fresh")],
        env=env,
        check=True,
        timeout=120,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import x64mod

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        on = x64mod.export(tmp_path / "x64_on")
        wide = x64mod.export(tmp_path / "wide", x64=True)
    finally:
        jax.config.update("jax_enable_x64", before)
    fresh = tmp_path / "fresh"
    assert listing(on) == listing(fresh)
    for name in listing(fresh):
        assert (on / name).read_bytes() == (fresh / name).read_bytes(), name
    # the setting matters: traced with x64 on, the same function returns f32 and i64
    assert [o["dtype"] for o in manifest(fresh)["executable_outputs"]] == ["f32", "i32"]
    assert [o["dtype"] for o in manifest(wide)["executable_outputs"]] == ["f32", "i64"]
    assert (wide / "model.b2.mlir").read_bytes() != (fresh / "model.b2.mlir").read_bytes()


def test_python_numbers_are_weights_of_jaxs_default_dtypes(tmp_path):
    """As jax traces them (float32, int32), not as numpy reads them (a float64 weight
    would switch x64 on and make the output float64, failing the parity gate)."""
    out = export_jax(
        lambda p, x: x * p["s"] + p["i"],
        {"s": 2.0, "i": 3},
        inputs=[Input("x", np.float32, ("n", 3))],
        outputs=["y"],
        batch_sizes=[2],
        out_dir=tmp_path / "m",
    )
    assert manifest(out)["executable_outputs"][0]["dtype"] == "f32"
    with safe_open(out / "weights.safetensors", "numpy") as f:
        assert [f.get_tensor(k).dtype for k in ("i", "s")] == [np.int32, np.float32]
    with pytest.raises(ExportError, match="cannot be named '__metadata__'"):
        export_jax(
            lambda p, x: x * p["__metadata__"],
            {"__metadata__": np.float32(2.0)},
            inputs=[Input("x", np.float32, ("n", 3))],
            outputs=["y"],
            batch_sizes=[2],
            out_dir=tmp_path / "bad",
        )


def test_x64_follows_64_bit_inputs_and_weights(tmp_path):
    int64_sum = functools.partial(
        export_jax,
        lambda p, x: x.sum(-1) + p["b"],
        {"b": np.int64(1)},
        inputs=[Input("x", np.int64, ("n", 3))],
        outputs=["y"],
        batch_sizes=[2],
    )
    out = int64_sum(out_dir=tmp_path / "i64", provenance=FIXED)
    assert manifest(out)["executable_outputs"][0]["dtype"] == "i64"
    with pytest.raises(
        ExportError,
        match=r"^x64=False, but input 'x' \(int64\), weight 'b' "
        r"\(int64\) are 64-bit",
    ):
        int64_sum(out_dir=tmp_path / "no", x64=False)
    assert listing(tmp_path) == ["i64"]


# -- dispatch ------------------------------------------------------------------------------


def test_export_model_dispatches_on_the_model_type(models, tmp_path):
    model, variables = models["linen_cnn"]
    assert framework_of(models["nnx_mlp"]) == "flax.nnx"
    assert framework_of(model) == "flax.linen"
    assert framework_of(models["eqx_mlp"]) == "equinox"
    assert framework_of(lambda p, x: x) == "jax"
    with pytest.raises(ExportError, match="cannot export a int"):
        framework_of(3)
    with pytest.raises(ExportError, match="needs its variables"):
        export_model(model, inputs=IMAGE, outputs=["y"], batch_sizes=[1], out_dir=tmp_path / "a")
    with pytest.raises(ExportError, match="carries its own parameters"):
        export_model(
            models["eqx_mlp"],
            {"w": 1},
            inputs=X16,
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "b",
        )
    out = export_model(
        models["eqx_mlp"],
        inputs=X16,
        outputs=["y"],
        batch_sizes=[2],
        out_dir=tmp_path / "c",
        provenance=FIXED,
    )
    assert manifest(out)["executable_outputs"][0]["dims"] == {"a": 5}


def test_linen_refuses_rng_streams_and_mutable_collections(models, tmp_path):
    model, variables = models["linen_cnn"]
    with pytest.raises(ExportError, match=r"^apply_kwargs\['rngs'\]"):
        export_flax_linen(
            model,
            variables,
            apply_kwargs={"rngs": {}},
            inputs=IMAGE,
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "a",
        )
    with pytest.raises(ExportError, match="must run without RNG streams and without mutable"):
        export_flax_linen(
            model,
            variables,
            apply_kwargs={"train": True},
            inputs=IMAGE,
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "b",
        )
    assert listing(tmp_path) == []


class TwoOutputs(eqx.Module):
    """An Equinox model returning its two outputs as ``kind`` says."""

    linear: eqx.nn.Linear
    kind: str = eqx.field(static=True)

    def __call__(self, x):
        y, z = self.linear(x), jnp.sum(x)
        return {"tuple": (y, z), "list": [y, z], "dict": {"z": z, "y": y}}[self.kind]


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_equinox_outputs_may_be_a_tuple_a_list_or_a_mapping(tmp_path, kind):
    with f32():
        model = TwoOutputs(eqx.nn.Linear(4, 3, key=jax.random.key(0)), kind)
    out = export_equinox(
        model,
        inputs=[Input("x", np.float32, ("n", 4))],
        outputs=["y", "z"],
        batch_sizes=[2],
        out_dir=tmp_path / kind,
    )  # (the parity gate compared each output with the model's)
    assert [o["name"] for o in manifest(out)["executable_outputs"]] == ["y", "z"]


def test_equinox_refuses_stateful_layers(tmp_path):
    with f32():
        model, _state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="batch")
    with pytest.raises(ExportError, match=r"holds eqx\.nn\.StateIndex"):
        export_equinox(
            model,
            inputs=[Input("x", np.float32, ("n", 4))],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "bn",
        )
    assert listing(tmp_path) == []


# -- PyTorch: test_export_torch.py (`just test-torch`) ---------------------------------------


# -- the CLI ---------------------------------------------------------------------------------

FACTORY = """
import jax
import jax.numpy as jnp
import numpy as np
import equinox as eqx
from rsrv.export import ExportSpec, Input, Output

def make():
    model = eqx.nn.MLP(6, 2, 8, 1, key=jax.random.key(0), dtype=jnp.float32)
    return ExportSpec(model=model, inputs=[Input("x", np.float32, ("n", 6), letters="nf")],
                      outputs=[Output("y", letters="nk")], name="tiny_mlp",
                      options={"description": "from the CLI"})

def as_dict():
    spec = make()
    return {"model": spec.model, "inputs": spec.inputs, "outputs": spec.outputs}
"""


def rsrv_command() -> list[str]:
    exe = shutil.which("rsrv", path=str(Path(sys.executable).parent)) or shutil.which("rsrv")
    return [exe] if exe else [sys.executable, "-m", "rsrv.cli"]


def test_cli_exports_through_a_factory(tmp_path):
    (tmp_path / "factories.py").write_text(FACTORY)
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000"}
    done = subprocess.run(
        [
            *rsrv_command(),
            "export",
            "--module",
            "factories:make",
            "--out",
            str(tmp_path / "repo"),
            "--batch-sizes",
            "1,4,8",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "repo" / "tiny_mlp"
    assert done.stdout.strip() == f"wrote {out}"
    assert "tiny_mlp: parity ok at batch sizes 1, 4, 8: max abs err" in done.stderr
    doc = manifest(out)
    assert doc["description"] == "from the CLI"
    assert doc["batching"] == {"compiled_batch_sizes": [1, 4, 8]}
    assert doc["provenance"]["framework"] == "equinox"
    assert doc["provenance"]["exported_at"] == "2023-11-14T22:13:20Z"
    assert load_bundle(out).batch_sizes == (1, 4, 8)


def test_cli_file_factories_names_and_errors(tmp_path, capsys):
    factory = tmp_path / "factories.py"
    factory.write_text(FACTORY)
    repo = tmp_path / "repo"
    args = [
        "export",
        "--module",
        f"{factory}:as_dict",
        "--out",
        str(repo),
        "--batch-sizes",
        "2",
        "--no-parity",
    ]
    assert cli_main(args) == 0
    assert listing(repo) == ["as_dict"]  # no name in the spec: the factory's name
    assert manifest(repo / "as_dict")["provenance"]["jax_enable_x64"] is False
    assert cli_main([*args, "--name", "renamed", "--x64", "on"]) == 0
    assert listing(repo) == ["as_dict", "renamed"]
    assert manifest(repo / "renamed")["provenance"]["jax_enable_x64"] is True
    capsys.readouterr()

    assert cli_main(["export", "--module", "no_colon", "--out", str(repo)]) == 2
    assert "expected MODULE:FACTORY" in capsys.readouterr().err
    assert cli_main(["export", "--module", f"{factory}:missing", "--out", str(repo)]) == 2
    assert "has no callable 'missing'" in capsys.readouterr().err
    assert cli_main(["export", "--module", "no_such_module_here:make", "--out", str(repo)]) == 2
    assert "No module named 'no_such_module_here'" in capsys.readouterr().err
    assert (
        cli_main(
            ["export", "--module", f"{factory}:make", "--out", str(repo), "--batch-sizes", "1,x"]
        )
        == 2
    )
    assert "--batch-sizes '1,x'" in capsys.readouterr().err
    assert cli_main(["export", "--module", f"{factory}:as_dict", "--out", str(repo)]) == 1
    assert "no batch sizes" in capsys.readouterr().err
    assert cli_main([*args, "--name", "cached", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "--no-parity skips the gate: give one of them" in capsys.readouterr().err
    for name in ("../escaped", "sub/model", ".hidden"):  # a bundle no scan of repo finds
        assert cli_main([*args, "--name", name]) == 2
        assert f"model name {name!r} cannot name a bundle of {repo}" in capsys.readouterr().err
    assert listing(repo) == ["as_dict", "renamed"] and listing(tmp_path) == [
        "factories.py",
        "repo",
    ]


def test_export_spec_dicts_are_checked(tmp_path):
    from rsrv.export import export_spec

    with pytest.raises(ExportError, match=r"unknown key\(s\) modle"):
        export_spec({"modle": None, "inputs": [], "outputs": []}, tmp_path / "a")
    with pytest.raises(ExportError, match="must return an ExportSpec or a dict"):
        export_spec([1, 2], tmp_path / "a")
    with pytest.raises(ExportError, match="^the factory's dict has no outputs$"):
        export_spec({"model": lambda p, x: x, "inputs": []}, tmp_path / "a")
    typo = ExportSpec(
        model=lambda p, x: x,
        inputs=[Input("x", np.float32, ("n", 2))],
        outputs=["y"],
        batch_sizes=[1],
        options={"descripton": "typo"},
    )
    with pytest.raises(ExportError) as info:
        export_spec(typo, tmp_path / "a")
    assert str(info.value) == (
        "unknown option(s) 'descripton' for a jax model (known: client_inputs, "
        "client_outputs, description, model_py, parity, provenance, x64)"
    )
    assert not (tmp_path / "a").exists()
    assert isinstance(ExportSpec(model=None, inputs=[], outputs=[]).options, dict)
