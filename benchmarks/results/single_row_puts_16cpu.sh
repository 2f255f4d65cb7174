#!/usr/bin/env bash
# How the 16-core rows of benchmarks/results/single_row_puts.md were made: `python -m
# benchmarks.results.single_row_puts URL rollouts` on a 16-core host (the CPU side of a lent GPU
# machine; no GPU is used), over shared memory and TCP, for the code before (562d185's dataplane/,
# copied into .devcarry/before/ with this checkout's benchmarks/) and after, one after the other,
# twice. TransferQueue is left out (no
# Ray wheel there). The host has Python 3.12 and torch but no internet, so the rest travels in
# .devcarry/ (git-ignored), prepared on a machine with pip:
#
#   P="--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64"
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
#       -d .devcarry/whl mooncake-transfer-engine-non-cuda==0.3.13.post1 tensordict==0.15.3 "pyvers<0.3" msgpack
#   # Mooncake's native dependencies (libibverbs, libnuma, libcurl and theirs) from a Debian 12 host,
#   # into .devcarry/lib: what `ldd` lists for mooncake/*.so and its binaries, except glibc's,
#   # libstdc++, libgcc_s, libz, libssl, libcrypto, libffi and the libraries the wheel bundles.
#   cp -r <checkout of 562d185>/dataplane .devcarry/before/ && cp -r benchmarks .devcarry/before/
#
# Each code runs from its own folder: `python -m` puts the working directory first on sys.path.
#
# Then, on the 16-core host, from the checkout's root (OUT: where the output goes):
set -euo pipefail
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl
export LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
nproc
for round in 1 2; do
    for url in "mooncake://local?segment_bytes=1GiB" "mooncake://local?segment_bytes=1GiB&shm=false"; do
        for code in before after; do
            src=$PWD; [ "$code" = before ] && src=$PWD/.devcarry/before
            (cd "$src" && PYTHONPATH=/tmp/site:$src python3 -c "import dataplane; print('$code:', dataplane.__file__)" &&
                PYTHONPATH=/tmp/site:$src python3 -m benchmarks.results.single_row_puts "$url" rollouts 2>/dev/null) \
                | sed "s|^|$code ${url#*GiB} round $round: |" | tee -a "$OUT/single_row_puts_16cpu.txt"
        done
    done
done
