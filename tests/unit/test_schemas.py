"""The JSON Schemas in specs/ are generated from the msgspec types and committed fresh."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import msgspec
import pytest

from rsrv.bundle._manifest import MANIFEST_NAMES


@pytest.fixture(scope="module")
def gen_schemas(repo_root):
    path = repo_root / "scripts" / "gen_schemas.py"
    spec = importlib.util.spec_from_file_location("gen_schemas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def manifest_schema(repo_root) -> dict:
    return json.loads((repo_root / "specs" / "manifest.schema.json").read_text())


def test_committed_schemas_are_fresh(gen_schemas, repo_root):
    fresh = gen_schemas.render()
    assert sorted(fresh) == ["gateway.schema.json", "manifest.schema.json", "node.schema.json"]
    stale = [
        name
        for name, text in fresh.items()
        if not (repo_root / "specs" / name).is_file()
        or (repo_root / "specs" / name).read_text(encoding="utf-8") != text
    ]
    assert not stale, f"stale schema files {stale}: run `just schemas`"


def test_rendering_is_deterministic_and_canonical(gen_schemas):
    first, second = gen_schemas.render(), gen_schemas.render()
    assert first == second
    for text in first.values():
        assert text.endswith("}\n") and not text.endswith("\n\n")
        assert (
            text
            == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        )


def test_check_mode_detects_stale_files(gen_schemas, tmp_path):
    assert gen_schemas.main(["--out", str(tmp_path), "--check"]) == 1
    assert list(tmp_path.iterdir()) == []
    assert gen_schemas.main(["--out", str(tmp_path)]) == 0
    assert gen_schemas.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "node.schema.json").write_text("{}\n")
    assert gen_schemas.main(["--out", str(tmp_path), "--check"]) == 1


def test_manifest_schema_forbids_unknown_fields(manifest_schema):
    defs = manifest_schema["$defs"]
    for name in ("Manifest", "TensorSpec", "Batching", "MetaSpec"):
        assert defs[name]["additionalProperties"] is False, name
    assert defs["Manifest"]["required"] == ["format_version"]


def _example_manifests(repo_root: Path) -> list[tuple[str, object]]:
    docs = []
    for bundle in sorted((repo_root / "bundles").iterdir()):
        for name in MANIFEST_NAMES:
            path = bundle / name
            if path.is_file():
                decode = msgspec.toml.decode if name.endswith(".toml") else msgspec.yaml.decode
                docs.append((str(path.relative_to(repo_root)), decode(path.read_bytes())))
    spec = (repo_root / "specs" / "bundle.md").read_text()
    for lang, body in re.findall(r"```(yaml|toml)\n(# [\w-]+-example\n.*?)```", spec, re.S):
        decode = msgspec.toml.decode if lang == "toml" else msgspec.yaml.decode
        docs.append((f"specs/bundle.md ({lang})", decode(body.encode())))
    return docs


def test_example_manifests_validate_against_the_schema(repo_root, manifest_schema):
    jsonschema = pytest.importorskip("jsonschema")
    validator_cls = jsonschema.validators.validator_for(manifest_schema)
    validator_cls.check_schema(manifest_schema)
    validator = validator_cls(manifest_schema)
    docs = _example_manifests(repo_root)
    assert len(docs) >= 5  # the two example bundles, the spec's YAML, TOML and meta examples
    for where, doc in docs:
        errors = [e.message for e in validator.iter_errors(doc)]
        assert not errors, f"{where}: {errors}"
    bad = dict(docs[0][1], max_batch=8)
    assert not validator.is_valid(bad)


@pytest.mark.parametrize(
    ("schema", "refused", "accepted"),
    [
        ("gateway", {"endpoints": ["a"]}, {"endpoints": ["a:1", "[::1]:8001"]}),
        ("gateway", {"endpoints": ["a:1"], "listen": {"grpc": "x"}}, {"endpoints": ["a:1"]}),
        ("node", {"gpus": [-1]}, {"gpus": [0, "3", " cuda:1 ", "GPU-ab12", "MIG-x/1"]}),
        ("node", {"gpus": ["cuda:x"]}, {"gpus": 2}),
        (
            "node",
            {"global": {"scheduler": {"models": {"m": {"version_policy": {"specific": []}}}}}},
            {"global": {"scheduler": {"models": {"m": {"version_policy": {"specific": [2]}}}}}},
        ),
    ],
)
def test_schemas_refuse_what_the_loaders_refuse(repo_root, tmp_path, schema, refused, accepted):
    """Where a rule fits a JSON Schema, the committed schema says it: an editor
    validating a file against it accepted each `refused` file, which the loader refuses."""
    jsonschema = pytest.importorskip("jsonschema")
    from rsrv.config import ConfigError, load_gateway, load_node

    document = json.loads((repo_root / "specs" / f"{schema}.schema.json").read_text())
    validator = jsonschema.validators.validator_for(document)(document)
    load = load_gateway if schema == "gateway" else load_node
    for doc, valid in ((refused, False), (accepted, True)):
        assert validator.is_valid(doc) is valid, doc
        path = tmp_path / "file.yaml"
        path.write_text(json.dumps(doc))  # (JSON is YAML)
        if valid:
            load(path, env={}) if schema == "gateway" else load(path)
        else:
            with pytest.raises(ConfigError):
                load(path, env={}) if schema == "gateway" else load(path)
