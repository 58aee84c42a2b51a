#!/bin/bash
# Step cost of two versions of the plugin side by side, in one device call: the working
# tree against an earlier commit, alternating engines on the same machine, so a change
# is judged by ratios measured in one run (machines differ: the same commit's DDTree
# step moved by 13% between two lent H200s).
#
#   bash scripts/gpu_ab.sh prepare REF     # here: REF's vllm_ddtree/ into ab_ref/ (ignored)
#   bash scripts/gpu_ab.sh run             # device, in the call carrying the kit's last
#                                          # chunk and ab_ref (carry "ab_ref")
#
# AB_METHODS (default ddtree), AB_BATCHES (default 1), AB_ROUNDS (default 2), AB_RUNNER
# (DDTree's model runner, default v1, the settings of the earlier A/B runs): each round
# runs REF then the working tree, one engine per method, through bench_gpu_step.py with
# the step-cost settings of docs/benchmarks.md. Results: $OUT/ab_{ref,new}_ROUND.json,
# and a table of ms/step per engine and the new/ref ratio per round.
set -uo pipefail
what=${1:-}; shift || true
if [ "$what" = prepare ]; then
  ref=${1:?usage: gpu_ab.sh prepare REF}
  rm -rf ab_ref && mkdir ab_ref || exit 1
  git archive "$ref" vllm_ddtree | tar -x -C ab_ref || exit 1
  git rev-parse "$ref" > ab_ref/REF
  echo "ab_ref: vllm_ddtree at $(cat ab_ref/REF)"
  exit 0
fi
[ "$what" = run ] || { echo "usage: gpu_ab.sh prepare REF | run" >&2; exit 2; }
[ -d ab_ref/vllm_ddtree ] || { echo "ab_ref/ is missing: run 'prepare' here, carry ab_ref" >&2; exit 2; }
out=${OUT:-gpu-out}; mkdir -p "$out"
bash .gpukit/install_vllm_kit.sh || exit 1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 VLLM_CACHE_ROOT=/root/vllm-cache \
  PYTHONUNBUFFERED=1
dist=/root/site/vllm_ddtree-0.0.dev0.dist-info; mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0.0.dev0\n' > "$dist/METADATA"
printf '[vllm.general_plugins]\nddtree = vllm_ddtree:register\n' > "$dist/entry_points.txt"
args="--runners v1 --ddtree-runners ${AB_RUNNER:-v1} --budgets 16 --batches ${AB_BATCHES:-1} --methods ${AB_METHODS:-ddtree}
  --short-len 32 --long-len 160 --repeats 2 --sync-scheduling --no-tree-ops"
rc=0
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for version in ref new; do
    tree=$PWD; [ "$version" = ref ] && tree=$PWD/ab_ref
    # The engine imports the plugin through its entry point: the first vllm_ddtree on
    # the path is the one measured.
    where=$(PYTHONPATH=/root/site:$tree:$PWD python3 -c "import vllm_ddtree; print(vllm_ddtree.__file__)")
    echo "[ab] round $round, $version: $where"
    PYTHONPATH=/root/site:$tree:$PWD timeout "${AB_TIMEOUT:-240}" python3 \
      benchmarks/bench_gpu_step.py $args --out "$out/ab_${version}_$round.json" \
      > "$out/ab_${version}_$round.log" 2>&1
    brc=$?; echo "[ab] exit code $brc"; [ "$brc" = 0 ] || rc=$brc
  done
done
python3 - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| round | method | batch | ref ms/step | new ms/step | new / ref |")
print("|---|---|---|---|---|---|")
for ref_path in sorted(out.glob("ab_ref_*.json")):
    n = ref_path.stem.rsplit("_", 1)[1]
    new_path = out / f"ab_new_{n}.json"
    if not new_path.exists():
        continue
    def rows(path):
        return {(r["method"], row["batch"]): row["ms_per_step"]
                for r in json.loads(path.read_text())["runs"] for row in r.get("rows", [])}
    ref, new = rows(ref_path), rows(new_path)
    digests = [json.loads(p.read_text())["environment"].get("plugin_digest")
               for p in (ref_path, new_path)]
    print(f"<!-- round {n}: plugin digests ref {digests[0]}, new {digests[1]} -->")
    for key in sorted(ref.keys() & new.keys()):
        print(f"| {n} | {key[0]} | {key[1]} | {ref[key]:.3f} | {new[key]:.3f} "
              f"| {new[key] / ref[key]:.3f} |")
EOF
exit "$rc"
