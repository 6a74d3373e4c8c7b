"""PyTorch export end to end (specs/export.md §2, §7, §8).

A small CNN with batch norm (parameters, running statistics, a non-persistent buffer and
a tensor held as a plain attribute, which torch.export lifts as a constant) is exported
through ``torch.export`` and torchax at batch sizes 1, 4 and 8 (the parity gate compares
the bundle with torch), checked with ``rsrv bundle check``, served by a real worker, and
its tritonclient answers compared with torch's own.

These tests run wherever torch and torchax work together: ``just test-torch`` builds such
an environment (``.venv-torch``) with the documented install and runs them there.
Elsewhere they are skipped with :func:`rsrv.export.torch_unavailable_reason`, which says
what to install; where torch and torchax are installed but do not work together, the last
test checks that every export is refused with that reason.
"""

from __future__ import annotations

import warnings
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from support.clients import infer_input

from rsrv.bundle import load_bundle
from rsrv.cli import main as cli_main
from rsrv.export import ExportError, Input, Output, Parity, export_torch, torch_unavailable_reason
from rsrv.export._torch import TORCHAX_REQUIREMENT, WORKING

SIZES = [1, 4, 8]
IMAGE = [Input("x", np.float32, ("n", 3, 8, 8), letters="nchw")]


@pytest.fixture(scope="module")
def torch():
    reason = torch_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    import torch

    return torch


def torch_cnn(torch):
    class TorchCNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.fc = torch.nn.Linear(4, 3)
            self.register_buffer("scale", torch.tensor(2.0), persistent=False)
            self.offset = torch.tensor([0.5, -0.25, 1.0])  # a lifted constant

        def forward(self, x):
            features = torch.relu(self.bn(self.conv(x))).mean((2, 3))
            return self.fc(features) * self.scale + self.offset

    torch.manual_seed(0)
    model = TorchCNN()
    with torch.no_grad():  # running statistics that are not the identity
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model  # in training mode, as built


@pytest.fixture(scope="module")
def exported(torch, tmp_path_factory, cache_dir):
    """The CNN exported into ``repo/torch_cnn``; the parity gate's executables go to the
    cache the ``worker`` fixture uses. Records the warnings the export raised."""
    model = torch_cnn(torch)
    repo = tmp_path_factory.mktemp("torch-export") / "repo"
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        filters_inside = list(warnings.filters)
        bundle = export_torch(
            model,
            inputs=IMAGE,
            outputs=[Output("logits", letters="nk")],
            batch_sizes=SIZES,
            out_dir=repo / "torch_cnn",
            parity=Parity(cache_dir=cache_dir),
        )
        restored = list(warnings.filters) == filters_inside
    return SimpleNamespace(
        model=model, repo=repo, bundle=bundle, warnings=list(raised), filters_restored=restored
    )


@pytest.fixture(scope="module")
def repo(exported) -> Path:
    """What the conftest ``worker`` fixture serves."""
    return exported.repo


def torch_answer(torch, model, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        was = model.training
        model.eval()
        try:
            return model(torch.from_numpy(x)).numpy()
        finally:
            model.train(was)


def test_export_writes_the_bundle_and_leaves_the_model_as_it_was(exported):
    assert exported.model.training  # exported in eval mode, then restored
    assert sorted(p.name for p in exported.repo.iterdir()) == ["torch_cnn"]  # no staging
    bundle = load_bundle(exported.bundle)
    assert bundle.batch_sizes == (1, 4, 8)
    # by state-dict key, in the order the converted program takes them: parameters, the
    # non-persistent buffer and the lifted constant, then the persistent buffers
    assert [w.name for w in bundle.weights.weights] == [
        "conv.weight",
        "conv.bias",
        "bn.weight",
        "bn.bias",
        "fc.weight",
        "fc.bias",
        "scale",
        "offset",
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    provenance = bundle.manifest.provenance
    assert provenance["framework"] == "torch"
    assert provenance["versions"]["torch"] == metadata.version("torch")
    assert provenance["versions"]["torchax"] == metadata.version("torchax")
    assert provenance["jax_enable_x64"] is True  # num_batches_tracked is int64


def test_export_raises_no_deprecation_warnings(exported):
    """torch's decompositions warn about its own deprecated LeafSpec, twice per program;
    the adapter ignores exactly that message, only while it converts."""
    assert [str(w.message) for w in exported.warnings if w.category is FutureWarning] == []
    assert exported.filters_restored


def test_bundle_check_compiles_it(exported, capsys):
    assert cli_main(["bundle", "check", str(exported.bundle)]) == 0
    out = capsys.readouterr().out
    assert "OK   torch_cnn" in out
    assert "batch sizes: 1, 4, 8" in out
    assert out.rstrip().endswith("1 ok, 0 failed")


def test_served_answers_match_torch(torch, exported, triton):
    rng = np.random.default_rng(7)
    for rows in (1, 3, 8):  # 3 is padded up to the compiled size 4
        x = rng.standard_normal((rows, 3, 8, 8)).astype(np.float32)
        got = triton.infer("torch_cnn", [infer_input("x", x)]).as_numpy("logits")
        assert got.shape == (rows, 3)
        np.testing.assert_allclose(
            got, torch_answer(torch, exported.model, x), rtol=1e-4, atol=1e-5, err_msg=f"{rows=}"
        )


FACTORY = """
import numpy as np
import torch
from rsrv.export import ExportSpec, Input, Output

def mlp():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return ExportSpec(model=model, inputs=[Input("x", np.float32, ("n", 6), letters="nf")],
                      outputs=[Output("y", letters="nk")], batch_sizes=[1, 2])
"""


def test_cli_exports_a_torch_factory(torch, tmp_path, capsys):
    factory = tmp_path / "factories.py"
    factory.write_text(FACTORY)
    repo = tmp_path / "repo"
    assert cli_main(["export", "--module", f"{factory}:mlp", "--out", str(repo)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {repo / 'mlp'}"
    bundle = load_bundle(repo / "mlp")
    assert bundle.batch_sizes == (1, 2)
    assert bundle.manifest.provenance["framework"] == "torch"


def test_unavailable_reason_names_the_extra_and_the_working_versions():
    reason = torch_unavailable_reason()
    if reason is None:
        pytest.skip("torch and torchax work together here")
    assert "pip install -e '.[torch]'" in reason and "CPU build of torch first" in reason
    assert TORCHAX_REQUIREMENT in reason
    assert WORKING in reason


def test_an_incompatible_pair_is_refused_with_the_reason(tmp_path):
    reason = torch_unavailable_reason()
    if reason is None:
        pytest.skip("torch and torchax work together here: the tests above cover the path")
    try:
        metadata.version("torch")
        torchax_version = metadata.version("torchax")
    except metadata.PackageNotFoundError:
        pytest.skip(reason)
    import torch

    assert reason.startswith(
        f"torchax {torchax_version} does not work with torch {torch.__version__}: "
    )
    with pytest.raises(ExportError) as info:
        export_torch(
            torch.nn.Linear(2, 2),
            inputs=[Input("x", np.float32, ("n", 2))],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "t",
        )
    assert str(info.value) == reason
    assert list(tmp_path.iterdir()) == []


def test_without_torch_the_reason_is_raised_as_an_export_error(tmp_path):
    try:
        metadata.version("torch")
    except metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("torch is installed here")
    with pytest.raises(ExportError) as info:
        export_torch(
            object(),
            inputs=[Input("x", np.float32, ("n", 2))],
            outputs=["y"],
            batch_sizes=[1],
            out_dir=tmp_path / "t",
        )
    assert str(info.value) == torch_unavailable_reason()
    assert list(tmp_path.iterdir()) == []
