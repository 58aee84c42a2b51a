#!/usr/bin/env bash
# Train the DFlash drafter on the lent GPU in two back-to-back calls (the machine
# stays warm about 30 s after a call; /root survives between warm calls):
#   call 1, carry [.dflash_kit/part_aa]:       bash training/device_run.sh stash
#   call 2, carry [.dflash_kit/part_ab, .dflash_kit/SHA256SUMS,
#                  .dflash_kit/prompts.json, .dflash_kit/gguf-0.19.0-py3-none-any.whl]:
#                                              bash training/device_run.sh train [ARGS]
# ARGS go to training.train_dflash. The checkpoint and log come back under $OUT.
set -euo pipefail
KIT=.dflash_kit
DEST=${KIT_DEST:-/root/kit}
SITE=${KIT_SITE:-/root/site}
PY=${PYTHON:-python3}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONUNBUFFERED=1
mkdir -p "$DEST"
case "${1:-}" in
  stash)
    cp "$KIT"/part_* "$DEST"/
    ls -la "$DEST"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    ;;
  train)
    shift
    if [ ! -f "$DEST/$GGUF" ]; then  # a warm machine may still have it
      cp "$KIT"/part_* "$DEST"/
      cat "$DEST"/part_a? > "$DEST/$GGUF"
    fi
    (cd "$DEST" && sha256sum -c "$OLDPWD/$KIT/SHA256SUMS") || {
      echo "GGUF incomplete: call 1 (stash) did not land on this machine"; exit 3; }
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KIT"/gguf-*.whl
    export PYTHONPATH="$SITE:$PWD" VLLM_DDTREE_CACHE="$DEST/cache"
    mkdir -p "$OUT"
    $PY -m training.train_dflash --gguf "$DEST/$GGUF" --prompts "$KIT/prompts.json" \
      --out "$OUT/dflash-smollm2-135m-b8" "$@" 2>&1 | tee "$OUT/train.log"
    ;;
  *)
    echo "usage: $0 stash|train [train_dflash args]"; exit 2 ;;
esac
