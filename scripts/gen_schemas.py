"""Generate the JSON Schemas in specs/ from the msgspec types (run with `just schemas`).

    python scripts/gen_schemas.py [--out DIR] [--check]

* specs/manifest.schema.json: a bundle's manifest.yaml / manifest.toml
  (``rsrv.bundle._manifest.Manifest``);
* specs/node.schema.json: a node file (``rsrv.config.node_json_schema()``).
* specs/gateway.schema.json: a gateway file (``rsrv.config.gateway_json_schema()``).

Output is deterministic (sorted keys, two-space indent, trailing newline), so the
committed files change only when the types do. ``--check`` writes nothing and exits 1
when a committed file is stale; tests/unit/test_schemas.py does the same check.
Editors validate a YAML manifest with e.g. a first line
``# yaml-language-server: $schema=<path to specs/manifest.schema.json>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "specs"


def node_schema() -> dict[str, Any]:
    from rsrv.config import node_json_schema

    return node_json_schema()


def gateway_schema() -> dict[str, Any]:
    from rsrv.config import gateway_json_schema

    return gateway_json_schema()


def manifest_schema() -> dict[str, Any]:
    from rsrv.bundle._manifest import Manifest

    return msgspec.json.schema(Manifest)


def render() -> dict[str, str]:
    """File name -> file text."""
    return {
        "manifest.schema.json": _dump(manifest_schema()),
        "node.schema.json": _dump(node_schema()),
        "gateway.schema.json": _dump(gateway_schema()),
    }


def _dump(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a file in --out is missing or stale",
    )
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if args.check and stale:
        print(f"stale: {', '.join(stale)} (run `just schemas`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
