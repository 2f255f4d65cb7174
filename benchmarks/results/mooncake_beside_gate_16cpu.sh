#!/usr/bin/env bash
# How benchmarks/results/*beside_gate_16cpu* were made: on a 16-core host (the CPU side of a lent GPU
# machine; no GPU is used), with Mooncake and tensordict carried in .devcarry/ as described in
# mooncake_xproc_16cpu.sh, and the code before the gate (the commit before it, `git archive HEAD
# benchmarks dataplane pyproject.toml`) in .devcarry/base. Each code runs from its own folder, so
# `python -m` imports that folder's dataplane; before and after alternate.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
REPEAT=${REPEAT:-15}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
nproc
python3 -m benchmarks.results.mooncake_beside_gate --repeat 30 --out "$OUT/mooncake_beside_gate_16cpu"
for r in 1 2; do
  (cd .devcarry/base && python3 -c 'import dataplane; print("before:", dataplane.__file__)' &&
    python3 -m benchmarks.mooncake_xproc --no-tq --repeat "$REPEAT" --out "$OUT/xproc_before_r$r")
  python3 -c 'import dataplane; print("after:", dataplane.__file__)'
  python3 -m benchmarks.mooncake_xproc --no-tq --repeat "$REPEAT" --out "$OUT/xproc_after_r$r"
done
