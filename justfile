# rsrv developer recipes. `just --list` shows them all.

# Run the test suite (CPU only; slow soak/benchmark tests are skipped).
test *args:
    python -m pytest -q {{args}}

# Serve the example bundles (or a node file) on 127.0.0.1:8001.
serve *args:
    rsrv serve {{args}}

# Regenerate src/rsrv/protocol/generated from proto/ (protobuf modules + purerpc stubs).
proto:
    python scripts/gen_proto.py

# Regenerate the JSON Schemas in specs/ from the msgspec types.
schemas:
    python scripts/gen_schemas.py

# Rebuild the example bundles in bundles/ (deterministic).
bundles:
    python scripts/make_bundles.py

# Validate and compile every example bundle.
check:
    rsrv bundle check bundles

# Lint and check the formatting (ruff).
lint:
    ruff check src tests scripts benchmarks
    ruff format --check src tests scripts benchmarks

# Fix lint findings and format (ruff).
fmt:
    ruff check --fix src tests scripts benchmarks
    ruff format src tests scripts benchmarks

# The PyTorch export end to end (tests/unit/export/test_export_torch.py) in its own environment,
# .venv-torch, installed as specs/export.md §8 says: torch first, then the torch extra.
# TORCH_INDEX=<the PyTorch CPU index> keeps a CUDA build of torch off a CPU machine (here
# `torch==2.13.0` finds the CPU wheel on disk); TORCH=<requirement> picks another torch.
[doc("The PyTorch export tests in their own environment, .venv-torch (see the comment).")]
test-torch *args:
    test -x .venv-torch/bin/python || python -m venv .venv-torch
    .venv-torch/bin/python -m pip install -q "${TORCH:-torch==2.13.0}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
    .venv-torch/bin/python -m pip install -q -e '.[dev,torch]'
    .venv-torch/bin/python -m pytest -q tests/unit/export/test_export_torch.py {{args}}

# Figures (needs the bench extra) under results/: `just bench` full (12-15 min), `just bench
# quick` (about 3 min), `just bench --only 2,7` some of them; one module per figure in
# benchmarks/figures/. Figures 1b and 9c need h2load (apt-get install nghttp2-client), 9c's
# C-proxy comparison nghttpx (nghttp2-proxy); each says so when it is missing.
# `just bench gpu` measures the accelerator weight path (benchmarks/gpu.py); without a GPU it
# says so and exits 0 (`just bench gpu --cpu-smoke` checks the script on the CPU).
[doc("Benchmark figures under results/: full, `quick`, `--only 2,7`, or `gpu`.")]
bench *args:
    python benchmarks/run.py {{args}}
