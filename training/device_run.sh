#!/usr/bin/env bash
# Train a DFlash drafter on the lent GPU with `python -m training`, across calls of at
# most 10 minutes (docs/training.md, "On the lent H200"). The machine stays warm about
# 30 s after a call, and /root survives between warm calls.
#
# The SmolLM2 target (its GGUF, 98 MB in three chunks, is more than one call may carry):
#   calls 1 and 2, carry [.dflash_kit/part_aa], then [.dflash_kit/part_ab]:
#                                                  bash training/device_run.sh stash
#   call 3, carry [.dflash_kit/part_ac, .dflash_kit/SHA256SUMS,
#                  .dflash_kit/prompts.json, .dflash_kit/gguf-0.19.0-py3-none-any.whl]:
#     bash training/device_run.sh train [ARGS]        a new run: --preset smollm2 ARGS
#     bash training/device_run.sh resume DIR [ARGS]   continue the run in DIR
# Any other target (carried, or already on the machine):
#     bash training/device_run.sh run ARGS            python -m training ARGS, as given
#
# The run lives in $RUN_DIR (default /root/runs/run, kept while the machine is warm);
# after the command, $RETURN (default: training_log.json learning_curve.png drafter
# state) is copied into $OUT/run, and the whole console log into $OUT/train.log. A call
# returns at most 8 files of at most 16 MiB: check the listing printed at the end.
set -euo pipefail
KIT=.dflash_kit
DEST=${KIT_DEST:-/root/kit}
SITE=${KIT_SITE:-/root/site}
PY=${PYTHON:-python3}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
RUN_DIR=${RUN_DIR:-/root/runs/run}
RETURN=${RETURN:-training_log.json learning_curve.png drafter state}
export PYTHONUNBUFFERED=1
mkdir -p "$DEST"

smollm2_kit() {  # the GGUF reassembled on this machine, and the gguf reader
  if [ ! -f "$DEST/$GGUF" ]; then  # a warm machine may still have it
    cp "$KIT"/part_* "$DEST"/ 2>/dev/null || true  # the chunk this call carries, if any
    cat "$DEST"/part_a? > "$DEST/$GGUF"
  fi
  (cd "$DEST" && sha256sum -c "$OLDPWD/$KIT/SHA256SUMS") || {
    echo "GGUF incomplete: call 1 (stash) did not land on this machine"; exit 3; }
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KIT"/gguf-*.whl
  export PYTHONPATH="$SITE:$PWD" VLLM_DDTREE_CACHE="$DEST/cache"
}

train() {  # python -m training "$@", its log and the chosen outputs under $OUT
  mkdir -p "$OUT" "$(dirname "$RUN_DIR")"
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
  set +e
  $PY -m training "$@" 2>&1 | tee "$OUT/train.log"
  local rc=${PIPESTATUS[0]}
  set -e
  if [ -d "$RUN_DIR" ] && [ "$(realpath "$RUN_DIR")" != "$(realpath -m "$OUT/run")" ]; then
    mkdir -p "$OUT/run"
    for f in $RETURN; do
      [ -e "$RUN_DIR/$f" ] && cp -r "$RUN_DIR/$f" "$OUT/run/"
    done
  fi
  echo "files back under \$OUT (at most 8, 16 MiB each, 64 MiB in all):"
  (cd "$OUT" && find . -type f -printf '%s %p\n' | sort -k2)
  return "$rc"
}

case "${1:-}" in
  stash)
    cp "$KIT"/part_* "$DEST"/
    ls -la "$DEST"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    ;;
  train)
    shift
    smollm2_kit
    rm -rf "$RUN_DIR"
    train --preset smollm2 --gguf "$DEST/$GGUF" --prompts "$KIT/prompts.json" \
      --out "$RUN_DIR" "$@"
    ;;
  resume)
    src=$2; shift 2
    smollm2_kit
    if [ "$(realpath -m "$src")" != "$(realpath -m "$RUN_DIR")" ]; then
      rm -rf "$RUN_DIR"  # a carried run: continue it in $RUN_DIR
      set -- --out "$RUN_DIR" "$@"
    fi
    train --resume "$src" --gguf "$DEST/$GGUF" "$@"
    ;;
  run)
    shift
    train "$@"
    ;;
  *)
    echo "usage: $0 stash | train [ARGS] | resume DIR [ARGS] | run ARGS"; exit 2 ;;
esac
