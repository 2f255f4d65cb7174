#!/usr/bin/env bash
# How benchmarks/results/mooncake_streaming_copy_16cpu.json and mooncake_xproc_16cpu_streamed.{md,json}
# were made: on a 16-core host (the CPU side of a lent GPU machine; no GPU is used), with Mooncake and
# tensordict carried in .devcarry/ as described in mooncake_xproc_16cpu.sh.
set -euo pipefail
OUT=${OUT:-benchmarks/results}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
nproc
(ldd --version | head -1) || true
/lib64/ld-linux-x86-64.so.2 --list-tunables | grep -E "non_temporal|shared_cache_size" || true
python3 -m benchmarks.results.mooncake_streaming_copy --repeat 20 --out "$OUT/mooncake_streaming_copy_16cpu" \
    > "$OUT/streaming_copy.log" 2>&1
python3 -m benchmarks.mooncake_xproc --no-tq --repeat 21 --out "$OUT/mooncake_xproc_16cpu_streamed" \
    > "$OUT/xproc.log" 2>&1
