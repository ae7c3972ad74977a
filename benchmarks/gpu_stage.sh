#!/usr/bin/env bash
# On the GPU machine, before benchmarks/gpu_check.py: install the carried wheels (.whl/, made by
# benchmarks/gpu_carry.sh) into /tmp/site without touching the network, and stash the carried half of the
# model (.carry/1 or .carry/2) in /tmp/izh-carry; once both halves are there (two device calls on the same
# warm machine), assemble /tmp/izh-carry/model.gguf and check its sha256. Exits 0 when the model is ready,
# 3 when a half is still missing. Use PYTHONPATH=/tmp/site:$PWD afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
dest=/tmp/izh-carry
mkdir -p "$dest"
for half in 1 2; do
    if [ -f ".carry/$half/model.part" ]; then
        cp ".carry/$half/model.part" "$dest/model.part$half"
        cp ".carry/$half/model.sha256" "$dest/model.sha256"
    fi
done
if [ ! -f "$dest/model.gguf" ]; then
    for half in 1 2; do
        if [ ! -f "$dest/model.part$half" ]; then
            echo "gpu_stage: half $half of the model is not on this machine yet (carry .carry/$half)"
            exit 3
        fi
    done
    cat "$dest/model.part1" "$dest/model.part2" >"$dest/model.gguf.tmp"
    if [ "$(sha256sum "$dest/model.gguf.tmp" | cut -d' ' -f1)" != "$(cat "$dest/model.sha256")" ]; then
        echo "gpu_stage: the assembled model does not match its sha256" >&2
        exit 4
    fi
    mv "$dest/model.gguf.tmp" "$dest/model.gguf"
fi
echo "gpu_stage: model ready at $dest/model.gguf ($(stat -c %s "$dest/model.gguf") bytes)"
