#!/usr/bin/env bash
# Set up the venv (as CI does) and run a short DDTree generation on the CPU.
#
#   bash scripts/demo.sh [--pair auto|real|tiny] [--budget N] [--topk-cap K] [--max-tokens T]
#
# The first run builds .venv-ci (a few minutes) and converts SmolLM2-135M to a
# checkpoint cached under ~/.cache/vllm-ddtree (about half a minute); later runs
# reuse both. `--help` lists every option.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/setup-venv.sh"

export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
exec "$VENV/bin/python" -m vllm_ddtree.demo "$@"
