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

lint:
    ruff check src tests scripts benchmarks
    ruff format --check src tests scripts benchmarks

fmt:
    ruff check --fix src tests scripts benchmarks
    ruff format src tests scripts benchmarks

# Figures (needs the bench extra) under results/: `just bench` full (< 15 min), `just bench quick` (< 3 min).
bench *args:
    python benchmarks/run.py {{args}}
