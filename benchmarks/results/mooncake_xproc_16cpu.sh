#!/usr/bin/env bash
# How benchmarks/results/mooncake_xproc_16cpu*.{md,json} were made: `python -m benchmarks.mooncake_xproc`
# on a 16-core host (the CPU side of a lent GPU machine; no GPU is used), shared memory and TCP,
# TransferQueue left out (no Ray wheel there). That host has Python 3.12 and torch but no internet, so
# the rest travels with the checkout in .devcarry/ (git-ignored), prepared on a machine with pip:
#
#   P="--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
#       -d .devcarry/whl mooncake-transfer-engine-non-cuda==0.3.13.post1 tensordict==0.15.3 "pyvers<0.3"
#   # Mooncake's native dependencies (libibverbs, libnuma, libcurl and theirs), copied from a Debian 12
#   # host where they are installed, into .devcarry/lib: every library `ldd` lists for mooncake/*.so and
#   # mooncake_master, except glibc's, libstdc++, libgcc_s, libz, libssl, libcrypto and libffi.
#
# Then, on the 16-core host, from the checkout's root (OUT: where the results go):
set -euo pipefail
OUT=${OUT:-benchmarks/results}
REPEAT=${REPEAT:-31}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
nproc
python3 -m benchmarks.mooncake_xproc --no-tq --repeat "$REPEAT" --out "$OUT/mooncake_xproc_16cpu"
python3 -m benchmarks.mooncake_xproc --no-tq --tcp --repeat "$REPEAT" --out "$OUT/mooncake_xproc_tcp_16cpu"
# several writers and readers at once (aggregate throughput)
python3 -m benchmarks.mooncake_concurrent --out "$OUT/mooncake_concurrent_16cpu"
python3 -m benchmarks.mooncake_concurrent --writers 4 --ops 4 --out "$OUT/mooncake_concurrent_4w_16cpu"
# the same shared-memory run with the helper thread off (a get then plans and decodes before its transfer)
DATAPLANE_DECODE_THREAD=0 python3 -m benchmarks.mooncake_xproc --no-tq --repeat "$REPEAT" \
    --out "$OUT/mooncake_xproc_16cpu_decode_off"
