# izh developer recipes. `just setup` once, then `just test`.

venv := ".venv"
py := venv + "/bin/python"

# Create the venv and install izh with its dev extras (CPU torch first: no multi-GB CUDA build).
setup:
    test -d {{venv}} || python3 -m venv {{venv}}
    {{py}} -m pip install -q --upgrade pip
    {{py}} -m pip install -q "torch==2.13.0"
    {{py}} -m pip install -q -e ".[dev]"
    {{venv}}/bin/izh pull smollm2

# Run the whole test suite (CPU).
test *ARGS:
    {{py}} -m pytest -q {{ARGS}}

# GPU-only tests (Triton kernels, CUDA graphs).
test-gpu:
    {{py}} -m pytest -q -m gpu tests/gpu

lint:
    {{venv}}/bin/ruff check izh izh_cli tests
    {{venv}}/bin/ruff format --check izh izh_cli tests
    {{venv}}/bin/mypy

fmt:
    {{venv}}/bin/ruff check --fix izh izh_cli tests
    {{venv}}/bin/ruff format izh izh_cli tests

# Serve the default model on 127.0.0.1:8000.
serve *ARGS:
    {{venv}}/bin/izh serve {{ARGS}}

# The prepared GPU check: correctness, then speed, < 6 min on one H200 (docs/operations.md, "GPU check").
# `just gpu-check --device cpu --dry-run` runs every phase's harness on a CPU (Triton's interpreter).
gpu-check *ARGS:
    PYTHONUNBUFFERED=1 $(test -x {{py}} && echo {{py}} || echo python3) benchmarks/gpu_check.py {{ARGS}}

# Offline engine throughput benchmark (writes bench_results/).
bench *ARGS:
    {{py}} benchmarks/offline_throughput.py {{ARGS}}

ci:
    bash .ci/run
