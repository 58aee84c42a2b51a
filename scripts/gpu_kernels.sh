#!/bin/bash
# Device side: the DDTree step's Triton kernels against their torch twins on the GPU,
# then (SANITIZE_TIMEOUT > 0) a memcheck pass of compute-sanitizer over the kernels changed
# or added since the last sanitized run (MEMCHECK_TESTS names their test files). Needs torch + Triton only (the vLLM kit's /root/site
# provides them on the lent H200); results go to $OUT (or ./gpu-out).
#   bash scripts/gpu_kernels.sh            # kernel tests, then memcheck (default 100 s)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
[ -d /root/site ] && export PYTHONPATH=/root/site:$PWD || export PYTHONPATH=$PWD
kernels="tests/kernels/test_topk.py tests/ops/test_tree.py tests/kernels/test_tree.py
  tests/kernels/test_step_trees.py tests/kernels/test_walk.py tests/kernels/test_compact_rows.py
  tests/kernels/test_kv_move.py tests/kernels/test_compact_step.py tests/runner/test_warmup.py
  tests/runner/test_tree_graph.py tests/runner/test_common.py"
python3 -m pytest -q -p no:cacheprovider --noconftest -n "${WORKERS:-4}" $kernels 2>&1 \
  | tee "$out/gpu_kernels.log" | tail -4
rc=${PIPESTATUS[0]}; echo "kernel tests exit code: $rc"
if [ "${SANITIZE_TIMEOUT:-100}" -gt 0 ]; then
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -z "$cs" ]; then echo "memcheck: compute-sanitizer not found"; exit "$rc"; fi
  # Graph capture is left out: memcheck does not follow kernels into graph replays.
  timeout "${SANITIZE_TIMEOUT:-100}" "$cs" --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider --noconftest -x -k "not graph" \
    ${MEMCHECK_TESTS:-tests/kernels/test_topk.py tests/kernels/test_step_trees.py tests/kernels/test_compact_step.py} \
    2>&1 | tee "$out/memcheck.log" | grep -E "ERROR SUMMARY|passed|failed|error" | tail -6
  echo "memcheck exit code: ${PIPESTATUS[0]} (124: cut at ${SANITIZE_TIMEOUT:-100} s)"
fi
exit "$rc"
