#!/usr/bin/env bash
# How benchmarks/results/mooncake_layout_16cpu.{md,json} were made: `python -m benchmarks.mooncake_layout`
# on the 16-core host of mooncake_xproc_16cpu.sh (the CPU side of a lent GPU machine; no GPU used),
# with the same .devcarry/ preparation (see that script's header). From the checkout's root:
set -euo pipefail
OUT=${OUT:-benchmarks/results}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
nproc
timeout 300 python3 -m benchmarks.mooncake_layout --repeat 15 --out "$OUT/mooncake_layout_16cpu"
