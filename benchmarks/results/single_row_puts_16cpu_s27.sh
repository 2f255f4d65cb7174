#!/usr/bin/env bash
# The 16-core rows of benchmarks/results/single_row_puts.md for session 27: `python -m
# benchmarks.results.single_row_puts URL rollouts` on a 16-core host (the CPU side of a lent GPU
# machine; no GPU is used), over shared memory and TCP, one after the other, twice, for three codes:
#   before: 4aa0bd6's dataplane/ (in .devcarry/before/, with this checkout's benchmarks/)
#   mid:    9e4028d's dataplane/ (equal offsets stored once; in .devcarry/mid/)
#   after:  9e4028d plus a trial that gathered the fields of a get on several threads (one per share
#           of the fields' bytes, up to 4). No gain over mid here or on the 2-core VM: not kept, so the
#           'after' rows of single_row_puts_16cpu_s27.txt are that trial's, not a committed version.
# .devcarry/ (git-ignored) is prepared as benchmarks/results/single_row_puts_16cpu.sh says, with
#   git archive <commit> dataplane | tar -x -C .devcarry/<code> && cp -r benchmarks .devcarry/<code>/
# Each code runs from its own folder: `python -m` puts the working directory first on sys.path.
set -euo pipefail
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl
export LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
nproc
for round in 1 2; do
    for url in "mooncake://local?segment_bytes=1GiB" "mooncake://local?segment_bytes=1GiB&shm=false"; do
        for code in before mid after; do
            src=$PWD; [ "$code" != after ] && src=$PWD/.devcarry/$code
            (cd "$src" && PYTHONPATH=/tmp/site:$src python3 -c "import dataplane; print('$code:', dataplane.__file__)" &&
                PYTHONPATH=/tmp/site:$src python3 -m benchmarks.results.single_row_puts "$url" rollouts 2>/dev/null) \
                | sed "s|^|$code ${url#*GiB} round $round: |" | tee -a "$OUT/single_row_puts_16cpu_s27.txt"
        done
    done
done
