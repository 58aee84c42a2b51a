#!/usr/bin/env bash
# Prepare, here, what the GPU training run needs in .dflash_kit/ (git-ignored):
#   part_aa..part_ac   the SmolLM2 GGUF (98 MB) in three chunks: one call may carry
#                      only 64 MiB with the repository (about 23 MiB: two drafters in
#                      models/), so back-to-back calls carry one each
#   SHA256SUMS         checksum of the reassembled GGUF
#   gguf-*.whl         the GGUF reader transformers needs (absent on the device)
#   prompts.json       the prompt corpus, built here so the run does not depend on
#                      the device's Python (stdlib docstrings differ by version)
#   prompts_large.json.gz  the same with 3,000 standard-library functions (13,610
#                      prompts; the block-16 drafter's), gzipped to fit a call
#   prompts_words.json.gz  that and 12,000 open requests around words of SmolLM2's
#                      vocabulary (25,610 prompts)
# Then see training/device_run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv-ci/bin/python}
KIT=.dflash_kit
grep -qx "/$KIT/" .git/info/exclude 2>/dev/null || echo "/$KIT/" >> .git/info/exclude
mkdir -p "$KIT"
GGUF=$($PY -c "from vllm_ddtree.checkpoints.smollm2 import smollm2_gguf_path as p; print(p())")
rm -f "$KIT"/part_*
split -b 33M "$GGUF" "$KIT/part_"
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > "$KIT/SHA256SUMS"
ls "$KIT"/gguf-*.whl >/dev/null 2>&1 || \
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$KIT" gguf==0.19.0
$PY -m training.prompts "$KIT/prompts.json"
$PY -m training.prompts "$KIT/prompts_large.json" --functions 3000
gzip -9f "$KIT/prompts_large.json"
vocab="$($PY -m vllm_ddtree.checkpoints.smollm2)/tokenizer.json"
$PY -m training.prompts "$KIT/prompts_words.json" --functions 3000 --words 12000 --vocab "$vocab"
gzip -9f "$KIT/prompts_words.json"
ls -la "$KIT"
