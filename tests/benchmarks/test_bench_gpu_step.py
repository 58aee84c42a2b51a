"""benchmarks/bench_gpu_step.py's step estimate from (short, long) generate calls, and
its flag on pairs whose estimate cannot be a step time."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_step as bench
import gpu_step_report as report


def sample(tokens: int, seconds: float) -> bench.Sample:
    """A DDTree call at batch 1 with nothing accepted: one draft per token."""
    return bench.Sample(max_tokens=tokens, seconds=seconds, tokens=tokens, drafts=tokens - 1,
                        accepted=0, iterations=tokens)


def measure(pairs, lengths=None):
    calls = iter([p for pair in [(sample(16, 0.2), sample(48, 0.5))] + pairs for p in pair])
    run = bench.EngineRun("v1", "ddtree", 16)
    args = SimpleNamespace(short_len=16, long_len=48, repeats=len(pairs), prompt_len=8,
                           shape=bench.QWEN3_8B)

    def run_call(prompts, n):
        if lengths is not None:
            lengths.append(n)
        return next(calls)

    return bench.measure_batch(run_call, run, 1, args)


def test_warm_ups_reach_the_long_calls_length_before_timing():
    lengths = []
    measure([(sample(16, 0.20), sample(48, 0.52))], lengths)
    assert lengths == [16, 48, 16, 48]  # two untimed calls (short, long), then the pair


def test_sound_pairs_give_the_step_time_and_no_flag():
    row = measure([(sample(16, 0.20), sample(48, 0.52)), (sample(16, 0.21), sample(48, 0.53))])
    assert abs(row["ms_per_step"] - 10.0) < 1e-6  # 0.32 s over 32 more steps
    assert "suspect" not in row


def test_a_one_time_cost_in_the_short_call_is_flagged():
    """The H200 run of 2026-11-30: 0.510 s for 16 tokens, 0.515 s for 48."""
    row = measure([(sample(16, 0.5095), sample(48, 0.5145))])
    assert row["ms_per_step"] < 1.0
    assert row["suspect"].startswith("suspect: 1 of 1 pairs")
    assert "suspect" in report.step_table([{"runner": "v1", "method": "ddtree", "budget": 16,
                                           "error": None, "rows": [row]}])


def test_plugin_share_as_the_engine_runs_it():
    """The engine replays the build from a CUDA graph and launches the walk and the
    compaction eagerly: the share it reports adds exactly those three."""
    ops = [{"batch": 1, "budget": 16, "ops_graph_ms": 0.1, "ops_eager_ms": 1.0,
            "build_graph_ms": 0.11, "walk_eager_ms": 0.09, "compact_eager_ms": 0.25,
            "walk_graph_ms": 0.02, "compact_graph_ms": 0.02}]
    records = [{"runner": "v1", "method": "ddtree", "budget": 16,
                "rows": [{"batch": 1, "ms_per_step": 10.0}]}]
    report.add_shares(ops, records)
    assert abs(ops[0]["ops_engine_ms"] - 0.45) < 1e-9
    assert abs(ops[0]["share_engine_pct"] - 4.5) < 1e-9
    assert "| 0.450 | 4.5 % |" in report.share_table(ops)


def test_plugin_digest_names_the_code_not_the_checkout(tmp_path):
    """Copies of one package share a digest; any edit, or a file moved, changes it; the
    run's environment records the digest of the plugin the engines import."""
    repo_pkg = Path(__file__).resolve().parents[2] / "vllm_ddtree"
    copy = tmp_path / "vllm_ddtree"
    for path in repo_pkg.rglob("*.py"):
        target = copy / path.relative_to(repo_pkg)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    assert report.plugin_digest(copy) == report.plugin_digest(repo_pkg)
    (copy / "ops" / "tree.py").write_text((copy / "ops" / "tree.py").read_text() + "\n# edited\n")
    assert report.plugin_digest(copy) != report.plugin_digest(repo_pkg)
    (copy / "ops" / "tree.py").write_bytes((repo_pkg / "ops" / "tree.py").read_bytes())
    (copy / "ops" / "tree.py").rename(copy / "ops" / "tree_moved.py")
    assert report.plugin_digest(copy) != report.plugin_digest(repo_pkg)
    env = report.environment(dry_run=True)
    assert env["plugin_digest"] == report.plugin_digest(repo_pkg)


def test_ddtree_runs_on_each_runner_asked_for():
    args = SimpleNamespace(runners=["v2"], ddtree_runners=["v1", "v2"],
                           methods=["chain", "ddtree"], budgets=[16], shape=bench.QWEN3_8B)
    assert [(r.runner, r.method, r.budget) for r in bench.plan_runs(args)] == [
        ("v2", "chain", None), ("v1", "ddtree", 16), ("v2", "ddtree", 16)]


def test_prefix_methods_pin_the_prefix_attention(tmp_path):
    """ddtree-triton / ddtree-flash are DDTree with ddtree_prefix_attention 'triton' /
    'flash_attn', planned per budget next to the default's DDTree engines."""
    args = SimpleNamespace(runners=["v1"], ddtree_runners=["v1"],
                           methods=["plain", "ddtree", "ddtree-triton", "ddtree-flash"],
                           budgets=[16, 32], shape=bench.QWEN3_8B)
    runs = bench.plan_runs(args)
    assert [(r.method, r.budget) for r in runs] == [
        ("plain", None), ("ddtree", 16), ("ddtree", 32), ("ddtree-triton", 16),
        ("ddtree-triton", 32), ("ddtree-flash", 16), ("ddtree-flash", 32)]
    spec = runs[3].speculative_config(tmp_path)
    assert spec["method"] == "ddtree" and spec["ddtree_prefix_attention"] == "triton"
    assert runs[5].speculative_config(tmp_path)["ddtree_prefix_attention"] == "flash_attn"
    assert "ddtree_prefix_attention" not in runs[1].speculative_config(tmp_path)


def test_scheduling_flags_set_every_engine_alike():
    """--sync-scheduling / --async-scheduling pin async_scheduling for every engine
    (DDTree's included); without either each engine keeps its default."""
    assert bench.scheduling_kwargs(bench.parse_args(["--dry-run"])) == {}
    assert bench.scheduling_kwargs(bench.parse_args(["--sync-scheduling"])) == {
        "async_scheduling": False}
    assert bench.scheduling_kwargs(bench.parse_args(["--async-scheduling"])) == {
        "async_scheduling": True}
    with pytest.raises(SystemExit):
        bench.parse_args(["--sync-scheduling", "--async-scheduling"])


def test_kimi_shape_plans_its_own_block_and_writes_a_kimi_pair(tmp_path):
    """--shape kimi-k2.6: Kimi K2.6's text config at full width, cut to one dense and
    --moe-layers MoE layers; a drafter of z-lab's Kimi shape reading every target
    layer; the chain drafts block 8 - 1; no dense-cache tree-ops timing."""
    import json

    args = bench.parse_args(["--shape", "kimi-k2.6", "--moe-layers", "1", "--budgets",
                             "8,16", "--batches", "1", "--runners", "v2",
                             "--model-dir", str(tmp_path)])
    assert (args.shape.layers, args.shape.block_size, args.no_tree_ops) == (2, 8, True)
    runs = bench.plan_runs(args)
    chain = next(r for r in runs if r.method == "chain")
    assert chain.speculative_config(tmp_path)["num_speculative_tokens"] == 7
    assert bench.verify_width(chain) == 8 and bench.capture_sizes(chain, args) == [8]
    target, drafter = bench.write_models(tmp_path, args.shape)
    text = json.loads((target / "config.json").read_text())["text_config"]
    assert (text["num_hidden_layers"], text["first_k_dense_replace"]) == (2, 1)
    assert (text["hidden_size"], text["n_routed_experts"], text["kv_lora_rank"]) == (
        7168, 384, 512)
    draft = json.loads((drafter / "config.json").read_text())
    assert draft["dflash_config"] == {"mask_token_id": 163838, "target_layer_ids": [0, 1]}
    assert (draft["num_hidden_layers"], draft["num_key_value_heads"], draft["block_size"],
            draft["rope_scaling"]["factor"]) == (6, 8, 8, 64.0)
    prompts = bench.make_prompts(2, 16, args.shape.prompt_token_max)
    assert max(max(p["prompt_token_ids"]) for p in prompts) < 163840
    with pytest.raises(SystemExit):
        bench.parse_args(["--shape", "kimi-k2.6", "--moe-layers", "0"])


def test_kimi_dry_run_writes_its_table(tmp_path, capsys):
    import json

    out = tmp_path / "kimi.json"
    bench.main(["--dry-run", "--shape", "kimi-k2.6", "--budgets", "8", "--batches", "1",
                "--runners", "v2", "--model-dir", str(tmp_path), "--out", str(out)])
    assert "Kimi K2.6 shape (1 dense + 2 MoE layers)" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert {(r["method"], r["budget"]) for r in saved["runs"]} == {
        ("plain", None), ("chain", None), ("ddtree", 8)}
    assert saved["tree_ops"] == []
