#!/bin/bash
export TRITON_CACHE_DIR=$PWD/.triton_cache PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 540 python benchmarks/kernels.py --ns 32 --impls ours_direct --grads fresh --budget-s 470 --out $OUT/n32.json > $OUT/n32.log 2>&1; echo "rc $?"
grep -E "ours_direct|budget" $OUT/n32.log | cut -c1-130
