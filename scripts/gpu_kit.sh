#!/bin/bash
# Here, before the device calls: build the vLLM 0.33 kit (../shared/gpu/build_vllm_kit.sh)
# and cut it into chunks that fit one call next to this repository. A call carries at
# most 64 MiB, the repository is about 23 MiB (the two trained drafters in models/), and
# the kit's own 60 MiB chunks do not fit beside it.
#   bash scripts/gpu_kit.sh          # dense targets
#   bash scripts/gpu_kit.sh --moe    # with vLLM's fused-MoE extension (DeepSeek-V3, Kimi): 4 chunks
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
kit_builder=${KIT_BUILDER:-../shared/gpu/build_vllm_kit.sh}
moe=(); [ "${1:-}" = "--moe" ] && moe=(--moe)
cache=${GPUKIT_CACHE:-/tmp/gpukit-cache${moe:+-moe}}
if [ ! -f "$cache/kit.tar.xz" ]; then
  # The two kits share their downloads.
  plain=/tmp/gpukit-cache; mkdir -p "$cache"
  [ "$cache" != "$plain" ] && [ -d "$plain/whl" ] && cp -rn "$plain"/*.whl "$plain/whl" "$cache"/ 2>/dev/null
  GPUKIT_CACHE=$cache bash "$kit_builder" "${moe[@]}"
fi
mkdir -p .gpukit
rm -f .gpukit/part_*
split -b "${CHUNK:-36M}" "$cache/kit.tar.xz" .gpukit/part_
(cd .gpukit && ls part_* > MANIFEST && sha256sum < "$cache/kit.tar.xz" | cut -d' ' -f1 >> MANIFEST)
repo=$(git ls-files -z | xargs -0 du -cb | tail -n 1 | cut -f1)
for part in .gpukit/part_*; do
  echo "$part: $(( ($(stat -c %s "$part") + repo) / 1048576 )) MiB with the repository (limit 64)"
done
