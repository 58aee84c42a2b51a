"""benchmarks/bench_e2e.py without engines: method selection, its argument errors, and
the table and plot it renders from a results file (the H200 run is rendered this way,
since its call ended before the script's own table)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_e2e as bench


def row(temperature: float, batch: int, tau: float, tok_per_s: float,
        seconds_each: list[float] | None = None) -> dict:
    r = {"temperature": temperature, "batch": batch, "tokens": 64, "seconds": 64 / tok_per_s,
         "tok_per_s": tok_per_s, "steps": round(64 / tau), "tau": tau,
         "accept_rate_per_depth": [0.5, 0.25]}
    if seconds_each is not None:
        r["seconds_each"] = seconds_each
    return r


def test_methods_follow_the_methods_option(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 8}))
    args = bench.parse_args(["--methods", "chain,ddtree", "--budgets", "16", "32",
                             "--caps", "4", "none"])
    names = [name for name, _ in bench.methods(args, drafter)]
    assert names == ["chain", "ddtree-b16-k4", "ddtree-b16-knone", "ddtree-b32-k4",
                     "ddtree-b32-knone"]
    configs = dict(bench.methods(args, drafter))
    assert configs["chain"]["num_speculative_tokens"] == 7  # block size - 1
    assert configs["ddtree-b32-knone"]["ddtree_topk_cap"] is None
    only_plain = bench.parse_args(["--methods", "plain"])
    assert [name for name, _ in bench.methods(only_plain, drafter)] == ["plain"]


@pytest.mark.parametrize("argv", [["--methods", "ddtree,medusa"], ["--methods", ","],
                                  ["--baseline-runners", "v2"],
                                  ["--ddtree-scheduling", "eager"],
                                  ["--repeats", "0"], ["--tensor-parallel-size", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    error_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[0] in error_line  # the message names the option (not just the usage)


def test_render_prints_ratios_from_the_results_file(tmp_path, capsys):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": {
        "plain": [row(0.0, 1, 1.0, 400.0)],
        "chain": [row(0.0, 1, 4.0, 1000.0)],
        "ddtree-b16-k4": [row(0.0, 1, 5.0, 700.0, seconds_each=[0.2, 0.1, 0.1])],
    }}))
    results = bench.main(["--render", str(path)])
    assert set(results) == {"plain", "chain", "ddtree-b16-k4"}
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
             if line.startswith(("plain", "chain", "ddtree"))}
    assert lines["ddtree-b16-k4"][3:7] == ["5.00", "700.0", "1.75", "0.70"]  # tau, tok/s, x plain, x chain
    assert lines["chain"][5:7] == ["2.50", "1.00"]
    assert "(repeats" in " ".join(lines["ddtree-b16-k4"])  # the slowest repeat took 2x the fastest
    assert "x2.00)" in lines["ddtree-b16-k4"]
    assert "(repeats" not in " ".join(lines["chain"])


def test_render_without_plain_or_chain_rows(tmp_path, capsys):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": {"ddtree-b16-k4": [row(1.0, 8, 1.5, 900.0)]}}))
    bench.main(["--render", str(path)])
    fields = next(line.split() for line in capsys.readouterr().out.splitlines()
                  if line.startswith("ddtree"))
    assert fields[5:7] == ["nan", "nan"]


def interleaved_run(path: Path, chain_each: list[float], ddtree_each: list[float],
                    interleaved: bool = True) -> Path:
    path.write_text(json.dumps({"interleaved": interleaved, "results": {
        "chain": [row(0.0, 1, 1.5, 640.0, seconds_each=chain_each)],
        "ddtree-b16-k4": [row(0.0, 1, 2.0, 640.0, seconds_each=ddtree_each),
                          row(1.0, 1, 1.5, 640.0, seconds_each=ddtree_each)],  # no chain row
    }}))
    return path


def test_pool_pairs_each_round_with_the_chains_and_pools_the_runs(tmp_path, capsys):
    # Run 1's rounds: ratios 2.0, 1.0, 1.25 (the chain's time over DDTree's, same tokens);
    # run 2's: 1.5, 1.5. Ratio of medians would say 1.0 for run 1; paired, its median is 1.25.
    a = interleaved_run(tmp_path / "a.json", [0.2, 0.1, 0.25], [0.1, 0.1, 0.2])
    b = interleaved_run(tmp_path / "b.json", [0.3, 0.15], [0.2, 0.1])
    out = tmp_path / "pooled"
    rows = bench.main(["--pool", str(a), str(b), "--out", str(out)])["rows"]
    assert len(rows) == 1  # the T=1 row has no chain row to pair with
    r = rows[0]
    assert (r["method"], r["temperature"], r["batch"], r["rounds"]) == ("ddtree-b16-k4", 0.0, 1, 5)
    assert [run["median"] for run in r["runs"]] == pytest.approx([1.25, 1.5])
    assert r["median"] == pytest.approx(1.5)  # of 2.0, 1.0, 1.25, 1.5, 1.5
    assert (r["min"], r["max"]) == pytest.approx((1.0, 2.0))
    assert r["share_at_target"] == pytest.approx(0.6)  # 2.0, 1.5, 1.5 reach 1.3
    low, high = r["interval_90"]
    assert 1.0 <= low <= r["median"] <= high <= 2.0
    assert json.loads((tmp_path / "pooled.json").read_text())["rows"] == rows
    table = capsys.readouterr().out
    assert "1.25 1.50" in table and ">= 1.3" in table


def test_pool_refuses_runs_that_were_not_interleaved(tmp_path):
    path = interleaved_run(tmp_path / "a.json", [0.2], [0.1], interleaved=False)
    with pytest.raises(SystemExit, match="not an --interleave run"):
        bench.main(["--pool", str(path), "--out", str(tmp_path / "p")])


def test_bootstrap_interval_is_seeded_and_follows_the_runs():
    runs = [[1.1, 1.2, 1.3, 1.25], [1.4, 1.35, 1.5]]
    assert bench.bootstrap_median(runs) == bench.bootstrap_median(runs)
    assert bench.bootstrap_median([[1.2] * 5]) == (1.2, 1.2)
    low, high = bench.bootstrap_median(runs)
    assert 1.1 <= low < high <= 1.5
    # Two runs that disagree: a run drawn twice is as likely as both, so the interval
    # spans from one run's level to the other's.
    assert bench.bootstrap_median([[1.0] * 10, [1.6] * 10]) == (1.0, 1.6)


class FakeLLM:
    """Stands in for vllm.LLM: records its arguments, emits max_tokens tokens."""

    made: ClassVar[list[dict]] = []
    engines: ClassVar[list[FakeLLM]] = []

    def __init__(self, **kwargs):
        import os

        FakeLLM.made.append({**kwargs, "env_v2": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")})
        FakeLLM.engines.append(self)
        self.calls: list[list[str]] = []  # the prompts of each generate call
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def get_tokenizer(self):
        return SimpleNamespace(apply_chat_template=lambda messages, **_: messages[0]["content"])

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(list(prompts))
        out = SimpleNamespace(token_ids=list(range(params.max_tokens)))
        return [SimpleNamespace(outputs=[out]) for _ in prompts]

    def get_metrics(self):
        return []


def fake_engines(tmp_path, monkeypatch) -> Path:
    """vllm.LLM replaced by FakeLLM (its record emptied); returns a drafter directory
    of block size 8 for bench.main."""
    import vllm

    FakeLLM.made, FakeLLM.engines = [], []
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 8}))
    return drafter


def test_tensor_parallel_size_reaches_every_engine_and_the_results(tmp_path, monkeypatch):
    drafter = fake_engines(tmp_path, monkeypatch)
    out = tmp_path / "tp2"
    bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--budgets", "16",
                "--caps", "4", "--max-tokens", "4", "--tensor-parallel-size", "2",
                "--out", str(out)])
    assert [m["tensor_parallel_size"] for m in FakeLLM.made] == [2, 2, 2]  # plain, chain, tree
    assert json.loads(out.with_suffix(".json").read_text())["tensor_parallel_size"] == 2


def test_baseline_runners_add_v1_rows_without_async_scheduling(tmp_path, monkeypatch, capsys):
    """DDTree runs vLLM's V1 runner without async scheduling; --baseline-runners v1 adds
    plain and chain rows under the same settings next to vLLM's defaults."""
    drafter = fake_engines(tmp_path, monkeypatch)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # as a DDTree engine leaves it
    out = tmp_path / "runners"
    bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--methods",
                "plain,chain", "--baseline-runners", "default,v1", "--max-tokens", "4",
                "--out", str(out)])
    made = {("plain", "chain")[m["speculative_config"] is not None]
            + ("-v1" if m.get("async_scheduling") is False else ""): m for m in FakeLLM.made}
    assert sorted(made) == ["chain", "chain-v1", "plain", "plain-v1"]
    assert made["chain"]["env_v2"] is None and "async_scheduling" not in made["chain"]
    assert made["chain-v1"]["env_v2"] == "0"
    saved = json.loads(out.with_suffix(".json").read_text())
    assert sorted(saved["results"]) == sorted(made) == sorted(saved["engines"])
    assert "x ch-v1" in capsys.readouterr().out  # both chains: a column for each


def test_scheduling_options_set_each_engines_runner_and_scheduling(tmp_path, monkeypatch):
    """--baseline-runners v1-async and --ddtree-scheduling v2,default,sync,async,v1: one
    engine per setting, each started with its own runner and scheduling, named by suffix."""
    drafter = fake_engines(tmp_path, monkeypatch)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    out = tmp_path / "sched"
    bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--methods",
                "chain,ddtree", "--baseline-runners", "default,v1-async", "--budgets", "16",
                "--caps", "4", "--ddtree-scheduling", "v2,default,sync,async,v1",
                "--max-tokens", "4", "--out", str(out)])
    saved = json.loads(out.with_suffix(".json").read_text())
    names = list(saved["results"])
    assert names == ["chain", "chain-v1-async", "ddtree-b16-k4-v2", "ddtree-b16-k4",
                     "ddtree-b16-k4-sync", "ddtree-b16-k4-async", "ddtree-b16-k4-v1"]
    made = dict(zip(names, FakeLLM.made, strict=True))
    assert made["chain"]["env_v2"] is None and "async_scheduling" not in made["chain"]
    assert made["chain-v1-async"]["env_v2"] == "0"
    assert made["chain-v1-async"]["async_scheduling"] is True
    assert "async_scheduling" not in made["ddtree-b16-k4"]
    # The V2 row asks for vLLM's V2 runner; the DDTree rows after it clear that again.
    assert made["ddtree-b16-k4-v2"]["env_v2"] == "1"
    assert "async_scheduling" not in made["ddtree-b16-k4-v2"]
    assert made["ddtree-b16-k4"]["env_v2"] is None
    assert made["ddtree-b16-k4-sync"]["async_scheduling"] is False
    assert made["ddtree-b16-k4-async"]["async_scheduling"] is True
    assert made["ddtree-b16-k4-v1"]["env_v2"] == "0"
    assert made["ddtree-b16-k4-v1"]["async_scheduling"] is False
    assert all(m["speculative_config"]["ddtree_budget"] == 16
               for n, m in made.items() if n.startswith("ddtree"))


def test_batch_1_runs_every_prompt_alone(tmp_path, monkeypatch):
    """Batch 1's timed calls give each of the four prompts alone, so its tau and
    tok/s are not one prompt's; batch 8 gives them all at once (twice each)."""
    drafter = fake_engines(tmp_path, monkeypatch)
    out = tmp_path / "b1"
    bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--methods", "plain",
                "--max-tokens", "4", "--repeats", "2", "--out", str(out)])
    (engine,) = FakeLLM.engines
    prompts = list(bench.PROMPTS.values())
    alone = [[p] for p in prompts]
    # Per temperature: batch 1's warm-up (every prompt alone, so no timed round meets
    # a prompt first), two timed rounds of the four, then batch 8's warm-up and two
    # timed calls.
    per_temperature = alone + alone + alone + [prompts * 2] * 3
    assert engine.calls == per_temperature * 2
    rows = json.loads(out.with_suffix(".json").read_text())["results"]["plain"]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(1, 16), (8, 32)] * 2
    # --quick (CI): batch 1 is the first prompt alone.
    bench.main(["--quick", "--target", str(tmp_path), "--drafter", str(drafter), "--methods",
                "plain", "--max-tokens", "4", "--out", str(out)])
    assert FakeLLM.engines[1].calls[:3] == [alone[0]] * 2 + [prompts * 2]


def test_out_ending_in_json_names_the_file_not_a_stem(tmp_path, monkeypatch):
    drafter = fake_engines(tmp_path, monkeypatch)
    out = tmp_path / "named.json"
    bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--methods", "plain",
                "--max-tokens", "4", "--out", str(out)])
    assert json.loads(out.read_text())["results"].keys() == {"plain"}
    assert not (tmp_path / "named.json.json").exists()


class CountingLLM(FakeLLM):
    """A FakeLLM with vLLM's spec-decode counters: every generate call adds one draft
    per prompt and ``accepted`` accepted tokens; a newer engine clears the registry, as
    vLLM's metrics do, so an older engine's counters read empty from then on.
    ``log`` records (engine, event) in order over all engines."""

    log: ClassVar[list[tuple[int, str]]] = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.index = len(FakeLLM.engines) - 1
        self.accepted = 1 + self.index  # tau 2, 3, ...: tells the engines' rows apart
        self.drafts = self.accepted_total = 0
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(
            shutdown=lambda: CountingLLM.log.append((self.index, "shutdown"))))

    def generate(self, prompts, params, use_tqdm=False):
        CountingLLM.log.append((self.index, "generate"))
        self.drafts += len(prompts)
        self.accepted_total += self.accepted * len(prompts)
        return super().generate(prompts, params, use_tqdm)

    def get_metrics(self):
        if FakeLLM.engines[-1] is not self:  # cleared by a newer engine
            return []
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens",
                                value=self.accepted_total)]


def test_interleave_times_live_engines_in_turn_and_counts_each_before_the_next(
        tmp_path, monkeypatch):
    import vllm

    drafter = fake_engines(tmp_path, monkeypatch)
    monkeypatch.setattr(vllm, "LLM", CountingLLM)
    CountingLLM.log = []
    out = tmp_path / "inter"
    bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--methods",
                "chain,ddtree", "--max-tokens", "4", "--repeats", "3", "--interleave",
                "--quick", "--out", str(out)])  # --quick: budget 8, cap 4
    chain, tree = FakeLLM.engines
    # Both engines alive through the timing (the default memory share, 0.3, fits twice
    # in 0.85), shut down only at the end.
    assert [m["gpu_memory_utilization"] for m in FakeLLM.made] == [0.3, 0.3]
    assert CountingLLM.log[-2:] == [(0, "shutdown"), (1, "shutdown")]
    # Start-up: each engine's warm-up and counted passes (four rows, one call each
    # with --quick) before the next engine starts; then every timed pass alternates
    # engines, the first engine of a round rotating.
    timed = [i for i, event in CountingLLM.log[16:-2] if event == "generate"]
    assert [i for i, _ in CountingLLM.log[:16]] == [0] * 8 + [1] * 8
    assert timed == [0, 1] * 4 + [1, 0] * 4 + [0, 1] * 4
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["interleaved"] is True
    rows = saved["results"]
    # tau from each engine's own counted pass (chain 1 + 1, tree 1 + 2), read while
    # its counters were live: read later, the cleared registry would give 1.0. One
    # draft per prompt and call: a count spanning the warm-up too would double these.
    assert [r["steps"] for r in rows["chain"]] == [1, 8, 1, 8]
    assert {r["tau"] for r in rows["chain"]} == {2.0}
    assert {r["tau"] for r in rows["ddtree-b8-k4"]} == {3.0}
    assert [len(r["seconds_each"]) for r in rows["chain"]] == [3] * 4
    assert [(r["temperature"], r["batch"]) for r in rows["chain"]] == [
        (0.0, 1), (0.0, 8), (1.0, 1), (1.0, 8)]


def test_interleave_refuses_memory_shares_that_do_not_fit_together(tmp_path, monkeypatch):
    drafter = fake_engines(tmp_path, monkeypatch)
    with pytest.raises(SystemExit, match="at most 0.317"):
        bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--budgets", "16",
                    "--caps", "4", "--interleave", "--gpu-memory-utilization", "0.4"])
    assert FakeLLM.made == []  # refused before any engine started
    # Left out, each of four engines gets 0.85 / 4 of the device.
    bench.main(["--target", str(tmp_path), "--drafter", str(drafter), "--methods",
                "plain,chain,ddtree", "--budgets", "16", "32", "--caps", "4", "--interleave",
                "--max-tokens", "4", "--out", str(tmp_path / "four")])
    assert [m["gpu_memory_utilization"] for m in FakeLLM.made] == [0.212] * 4
