#!/usr/bin/env bash
# Set up the venv (as CI does) and run a short DDTree generation on the CPU.
#
#   bash scripts/demo.sh [--budget N] [--topk-cap K] [--block-size B] [--max-tokens T]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../.ci/setup-venv.sh"

export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
exec "$VENV/bin/python" -m vllm_ddtree.demo "$@"
