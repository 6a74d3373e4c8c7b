"""The ``rsrv`` command line: ``serve``, ``bundle check`` and ``export``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rsrv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a worker: gRPC KServe V2 on the node's port")
    serve.add_argument(
        "node_file",
        nargs="?",
        help="node file (YAML or TOML); default: the built-in CPU node serving ./bundles on "
        "127.0.0.1:8001, or, when there is no ./bundles directory and rsrv runs from a "
        "source checkout, that checkout's example bundles (the log says which)",
    )
    serve.add_argument("--worker", help="which worker of the node file to run")

    bundle = sub.add_parser("bundle", help="bundle tools")
    bundle_sub = bundle.add_subparsers(dest="bundle_command", required=True)
    check = bundle_sub.add_parser("check", help="validate and compile bundles")
    check.add_argument(
        "dirs", nargs="+", type=Path, help="bundle directories, or repositories holding bundles"
    )

    export = sub.add_parser(
        "export", help="export a JAX / Flax / Equinox / PyTorch model to a bundle (specs/export.md)"
    )
    from rsrv.export import add_arguments

    add_arguments(export)

    args = parser.parse_args(argv)
    if args.command == "serve":
        from rsrv.worker import serve_main

        return serve_main(args.node_file, args.worker)
    if args.command == "bundle":
        from rsrv.bundle_check import check_main

        return check_main(args.dirs)
    if args.command == "export":
        from rsrv.export import export_main

        return export_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
