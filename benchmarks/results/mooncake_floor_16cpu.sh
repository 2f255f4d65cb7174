#!/usr/bin/env bash
# How benchmarks/results/mooncake_floor_16cpu* were made: on a 16-core host (the CPU side of a lent GPU
# machine; no GPU is used), with Mooncake and tensordict carried in .devcarry/ as described in
# mooncake_xproc_16cpu.sh.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
nproc
python3 -m benchmarks.results.mooncake_floor --repeat 40 --out "$OUT/mooncake_floor_16cpu" > "$OUT/floor_shm.log" 2>&1
python3 -m benchmarks.results.mooncake_floor --repeat 20 --tcp --out "$OUT/mooncake_floor_tcp_16cpu" > "$OUT/floor_tcp.log" 2>&1
