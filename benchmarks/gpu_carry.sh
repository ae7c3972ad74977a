#!/usr/bin/env bash
# Prepare, on a machine with network, what a device run of benchmarks/gpu_check.py carries (see
# docs/operations.md, "GPU check"): the model file in two halves (.carry/1, .carry/2: one call's working
# tree may hold 64 MiB and SmolLM2's Q4_1 GGUF is 94 MiB) with its sha256, and, in .whl/, the wheels of
# izh's dependencies that the GPU image lacks, at the versions installed here (CPython 3.12, manylinux).
#
#     bash benchmarks/gpu_carry.sh [MODEL.gguf]    # default ~/.cache/izh/models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Both folders are git-ignored. benchmarks/gpu_stage.sh unpacks them on the device machine.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-$HOME/.cache/izh/models/SmolLM2-135M-Instruct.Q4_1.gguf}
python=${PYTHON:-python3}

rm -rf .carry .whl
mkdir -p .carry/1 .carry/2 .whl
size=$(stat -c %s "$model")
half=$(((size + 1) / 2))
head -c "$half" "$model" >.carry/1/model.part
tail -c +"$((half + 1))" "$model" >.carry/2/model.part
sha256sum "$model" | cut -d' ' -f1 | tee .carry/1/model.sha256 >.carry/2/model.sha256

# Not in the image (KINDS.md's package list): the offline engine needs gguf, llguidance and msgspec;
# `izh serve` also the HTTP stack and pyzmq.
packages=(gguf llguidance msgspec pyzmq fastapi starlette uvicorn pydantic pydantic_core pydantic-settings
    python-dotenv annotated-types typing-inspection sniffio)
pins=()
for p in "${packages[@]}"; do
    pins+=("$p==$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
done
platforms=()
for n in 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}"
du -sh .carry/1 .carry/2 .whl
