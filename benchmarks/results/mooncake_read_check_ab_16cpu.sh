#!/bin/bash
# How the 16-core half of benchmarks/results/mooncake_read_check_ab.md was made, on the 16-core host (see
# mooncake_xproc_16cpu.sh for .devcarry). abbase/ holds the code before the read check (31420bd):
#   mkdir abbase && git archive 31420bd | tar -x -C abbase
# Each run alternates baseline and current code, twice.
OUT=${OUT:-/tmp/ab_out}
# single calls (mooncake_xproc, 16 MB, 21 repetitions each)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/whl/*.whl 2>&1 | tail -2
export LD_LIBRARY_PATH=$PWD/.devcarry/lib PYTHONUNBUFFERED=1
mkdir -p $OUT/ab
for i in $(seq ${N:-2}); do
for R in abbase .; do
  tag=$( [ "$R" = "." ] && echo new || echo base )
  (cd $R && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m benchmarks.mooncake_xproc --no-tq --sizes 16 --repeat 21 --out $OUT/ab/${tag}_$i > $OUT/ab/${tag}_$i.log 2>&1)
  echo "$tag $i $(grep -E 'get_ours_vs_raw_paired|get_ours_zc_vs_raw_paired|put_ours_zc_vs_raw_paired' $OUT/ab/${tag}_$i.md | tr -d '|*' | awk '{print $2"="$3}' | tr '\n' ' ')"
done; done

# several writers and readers at once (mooncake_concurrent, 16 MB, 15 repetitions each)
for i in $(seq ${N:-2}); do
for R in abbase .; do
  tag=$( [ "$R" = "." ] && echo new || echo base )
  (cd $R && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m benchmarks.mooncake_concurrent --sizes 16 --repeat 15 --out $OUT/ab/c${tag}_$i > $OUT/ab/c${tag}_$i.log 2>&1)
  echo "$tag $i $(grep -E '^\| 16MB' $OUT/ab/c${tag}_$i.md | tail -1)"
done; done
