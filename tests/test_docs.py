"""The READMEs against the repository: every results file and image they cite exists,
and the figures of the real pair's tables are the ones in the results files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "benchmarks" / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"


def results_rows(name: str) -> dict[str, list[dict]]:
    return json.loads((RESULTS / name).read_text())["results"]


def row_at(rows: list[dict], t: float, batch: int) -> dict:
    return next(x for x in rows if x["temperature"] == t and x["batch"] == batch)


def greedy(rows: list[dict], batch: int) -> dict:
    return row_at(rows, 0.0, batch)


def assert_tau_speed_step(r: dict, tau: str, tok_s: str, ms: str, where) -> None:
    """A doc row's tau, whole tok/s and ms per verify step are the results row's."""
    assert float(tau) == round(r["tau"], 2), where
    assert int(tok_s) == round(r["tok_per_s"]), where
    assert float(ms) == round(1000 * r["seconds"] / r["steps"], 1), where


def block_after(text: str, heading_line: str) -> list[list[str]]:
    """Rows of the fenced block that starts with ``heading_line``, split on spaces."""
    start = text.index(heading_line)
    body = text[start:text.index("```", start)]
    return [line.split() for line in body.splitlines()[1:] if line.strip()]


@pytest.mark.parametrize("doc,base", [(README, ROOT), (BENCH_README, ROOT / "benchmarks")])
def test_cited_results_files_exist(doc, base):
    cited = set(re.findall(r"(?:benchmarks/)?results/[\w.\-]+\.(?:json|png|txt|log)", doc))
    assert cited, "no results file cited"
    missing = [p for p in cited
               if not ((ROOT / p).exists() if p.startswith("benchmarks/") else (base / p).exists())]
    assert not missing, f"cited but not in the repository: {missing}"


def test_readme_shows_both_end_to_end_plots():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert "benchmarks/results/e2e_cpu.png" in images
    assert "benchmarks/results/e2e_h200.png" in images
    assert all((ROOT / image).exists() for image in images)


def test_readme_tau_table_is_the_results_files():
    cpu, gpu = results_rows("e2e_cpu.json"), results_rows("e2e_h200.json")
    rows = block_after(README, "                   CPU, float32")[1:]  # skip the column line
    assert rows, "the real pair's tau table is missing"
    for name, *cells in rows:
        values = [None if c == "-" else float(c) for c in cells]
        expected = [round(greedy(cpu[name], 1)["tau"], 2), round(greedy(cpu[name], 8)["tau"], 2)]
        if name in gpu:
            expected += [round(greedy(gpu[name], 1)["tau"], 2),
                         round(greedy(gpu[name], 8)["tau"], 2)]
        else:
            expected += [None, None]
        assert values == expected, name


def test_readme_h200_speed_table_is_the_results_file():
    gpu = results_rows("e2e_h200.json")
    repeats = json.loads((RESULTS / "e2e_h200.json").read_text()).get("repeats", 1)
    rows = block_after(README, "method          tau    tok/s   x plain   x chain")
    assert {r[0] for r in rows} == {"plain", "chain", "ddtree-b16-k4", "ddtree-b32-k4"}
    plain, chain = greedy(gpu["plain"], 1), greedy(gpu["chain"], 1)
    for name, tau, tok_s, x_plain, x_chain, ms in rows:
        r = greedy(gpu[name], 1)
        steps = r["steps"] / repeats if r["steps"] else r["tokens"]  # the file's steps span the repeats
        assert float(tau) == round(r["tau"], 2), name
        assert int(tok_s) == round(r["tok_per_s"]), name
        assert float(x_plain) == round(r["tok_per_s"] / plain["tok_per_s"], 2), name
        assert float(x_chain) == round(r["tok_per_s"] / chain["tok_per_s"], 2), name
        assert float(ms) == round(1e3 * r["seconds"] / steps, 1), name


def test_readme_tp2_table_is_the_results_file():
    tp = results_rows("e2e_h200x2_tp2_tiny.json")
    rows = block_after(README, "method          batch   tau    tok/s   x plain   x chain")
    assert {r[0] for r in rows} == {"plain", "chain", "ddtree-b16-k4"}
    assert len(rows) == 6
    for name, batch, tau, tok_s, x_plain, x_chain in rows:
        r, plain, chain = (greedy(tp[n], int(batch)) for n in (name, "plain", "chain"))
        assert float(tau) == round(r["tau"], 2), name
        assert int(tok_s) == round(r["tok_per_s"]), name
        assert float(x_plain) == round(r["tok_per_s"] / plain["tok_per_s"], 2), name
        assert float(x_chain) == round(r["tok_per_s"] / chain["tok_per_s"], 2), name


def block_after_file(text: str, name: str) -> tuple[list[str], list[list[str]]]:
    """Heading words and rows of the first fenced block after ``results/<name>``."""
    start = text.index("```", text.index(f"results/{name}")) + 3
    lines = [line for line in text[start:text.index("```", start)].splitlines() if line.strip()]
    return lines[0].split(), [line.split() for line in lines[1:]]


@pytest.mark.parametrize("name", ["e2e_h200_runners.json", "e2e_h200_rerun.json",
                                  "e2e_h200_async.json", "e2e_h200_runners2.json",
                                  "e2e_h200_v2.json", "e2e_h200_v2_fused.json",
                                  *(f"e2e_h200_6506348_{run}.json" for run in (1, 2, 3, 4)),
                                  "e2e_h200_interleave_1.json", "e2e_h200_interleave_2.json",
                                  "e2e_h200_stepgraphs.json",
                                  *(f"e2e_h200_17379b3_{run}.json" for run in (1, 2, 3)),
                                  "e2e_h200_b89fd64.json", "e2e_h200_b89fd64_2.json"])
def test_bench_readme_runner_tables_are_the_results_files(name):
    """benchmarks/README.md's H200 runs: tau, tok/s and the ratios to the rows named in
    the heading's "x <row>" columns (same temperature and batch) are the file's."""
    res = results_rows(name)
    heading, rows = block_after_file(BENCH_README, name)
    bases = [heading[i + 1] for i, word in enumerate(heading) if word == "x"]
    assert bases
    ref = {"plain": "plain", "chain": "chain", "ch-v1": "chain-v1"}
    assert {r[0] for r in rows} == set(res)
    assert len(rows) == 4 * len(res)
    for method, t, batch, tau, tok_s, *cells in rows:
        r = row_at(res[method], float(t), int(batch))
        assert float(tau) == round(r["tau"], 2), (method, t, batch)
        assert float(tok_s) == round(r["tok_per_s"], 1), (method, t, batch)
        for cell, base in zip(cells[:len(bases)], bases, strict=True):
            other = row_at(res[ref[base]], float(t), int(batch))
            assert float(cell) == round(r["tok_per_s"] / other["tok_per_s"], 2), (method, base)


def step_costs(name: str) -> dict[tuple[str, int], float]:
    """(method, batch) -> ms per step of a bench_gpu_step results file."""
    runs = json.loads((RESULTS / name).read_text())["runs"]
    return {(r["method"], row["batch"]): row["ms_per_step"] for r in runs for row in r["rows"]}


def test_readme_step_cost_table_is_the_results_files():
    """README.md's step-cost runs: batch 1 / batch 32 per method and run, as measured."""
    rows = block_after(README, "                   ms per step, batch 1 / batch 32")[1:]
    methods = {"plain": "plain", "dflash": "chain", "ddtree": "ddtree",
               "ddtree-triton": "ddtree-triton"}
    columns = [("gpu_step_20261130_8353b6f.json", 1), ("gpu_step_20261130_8353b6f.json", 32),
               ("gpu_step_20261130_d730192_b1.json", 1),
               ("gpu_step_20261130_c77bb45_b32.json", 32),
               ("gpu_step_20261130_0ed8e6b_b1.json", 1),
               ("gpu_step_20261130_f58d52e_b32.json", 32)]
    assert [row[0] for row in rows] == list(methods)
    for row in rows:
        numbers = [float(w.rstrip("*")) for w in row if re.fullmatch(r"\d+\.\d{3}\*?", w)]
        method = methods[row[0]]
        if method == "ddtree-triton":  # measured in d730192/c77bb45 only, batch 32 a call later
            cells = [("gpu_step_20261130_d730192_b1.json", 1),
                     ("gpu_step_20261130_c77bb45_b32_triton.json", 32)]
        else:
            cells = columns
        want = [round(step_costs(f)[(method, b)], 3) for f, b in cells]
        assert numbers == want, row


def test_bench_readme_8353b6f_table_is_the_results_file():
    costs = step_costs("gpu_step_20261130_8353b6f.json")
    runs = json.loads((RESULTS / "gpu_step_20261130_8353b6f.json").read_text())["runs"]
    rows = block_after(BENCH_README, "runner  method        batch 1   batch 32    ms per step "
                                     "(estimate of each pair)\nv1      plain           7.322")
    assert len(rows) == 3
    for row, run in zip(rows, runs, strict=True):
        numbers = [float(w) for w in row if re.fullmatch(r"\d+\.\d{3}", w)]
        estimates = [round(e["ms_per_step"], 3) for b in (1, 32)
                     for e in next(x for x in run["rows"] if x["batch"] == b)["estimates"]]
        assert numbers == [round(costs[(run["method"], 1)], 3),
                           round(costs[(run["method"], 32)], 3), *estimates], row


def test_readme_async_run_table_is_the_results_file():
    """README's batch-1 summary of run B (e2e_h200_runners2.json): tau, tok/s, ms per
    step (median call over its steps) and both chain ratios are the file's."""
    res = results_rows("e2e_h200_runners2.json")
    rows = block_after(README, "method          engine            tau   tok/s   ms per step")
    names = {("chain", "V2,"): "chain", ("chain", "V1,"): "chain-v1",
             ("ddtree-b16-k4", "sync"): "ddtree-b16-k4-sync",
             ("ddtree-b16-k4", "async"): "ddtree-b16-k4-async"}
    chain, chain_v1 = greedy(res["chain"], 1), greedy(res["chain-v1"], 1)
    seen = set()
    for method, runner, sched, tau, tok_s, ms, x_chain, x_v1 in rows:
        name = names[(method, runner if method == "chain" else sched)]
        seen.add(name)
        r = greedy(res[name], 1)
        assert_tau_speed_step(r, tau, tok_s, ms, name)
        assert float(x_chain) == round(r["tok_per_s"] / chain["tok_per_s"], 2), name
        assert float(x_v1) == round(r["tok_per_s"] / chain_v1["tok_per_s"], 2), name
    assert seen == set(res)


ASYNC_RUN, V2_RUN = "gpu_step_20261130_74f2c2b_async.json", "gpu_step_20261202_9d08fc0_v2.json"


@pytest.mark.parametrize("doc,heading,name", [
    (README, "runner  method         batch 1   batch 32   ms per step\n", ASYNC_RUN),
    (BENCH_README, "runner  method        batch 1   batch 32\n", ASYNC_RUN),  # nothing after "32"
    (README, "runner  method         batch 1   batch 32   ms per step (9d08fc0)", V2_RUN),
    (BENCH_README, "runner  method        batch 1   batch 32   ms per step (9d08fc0)", V2_RUN),
])
def test_step_cost_tables_are_the_results_file(doc, heading, name):
    """Both READMEs' step costs with async scheduling on both runners (74f2c2b), and
    with every engine on the V2 runner (9d08fc0)."""
    runs = json.loads((RESULTS / name).read_text())["runs"]
    costs = {(r["runner"], r["method"], row["batch"]): row["ms_per_step"]
             for r in runs for row in r["rows"]}
    rows = block_after(doc, heading)
    assert len(rows) == len(runs)
    for runner, *method, b1, b32 in rows:
        method = "ddtree" if method[0].startswith("ddtree") else method[0]
        assert [float(b1), float(b32)] == [round(costs[(runner, method, b)], 3)
                                           for b in (1, 32)], (runner, method)


def test_bench_readme_v1_v2_ddtree_table_is_the_results_files():
    """benchmarks/README.md's runs B and C: DDTree on V1 (-sync) and V2 (-v2), each row's
    tau and tok/s as measured and its ratio to the V1 row of the same T and batch."""
    res = {**results_rows("e2e_h200_v1v2.json"), **results_rows("e2e_h200_v1v2_b64.json")}
    rows = block_after(BENCH_README, "method               T batch    tau    tok/s   x V1")
    assert len(rows) == 4 * len(res) == 16
    for method, t, batch, tau, tok_s, x_v1 in rows:
        r = row_at(res[method], float(t), int(batch))
        v1 = row_at(res[method.rsplit("-", 1)[0] + "-sync"], float(t), int(batch))
        assert float(tau) == round(r["tau"], 2), method
        assert float(tok_s) == round(r["tok_per_s"], 1), method
        assert float(x_v1) == round(r["tok_per_s"] / v1["tok_per_s"], 2), method


def test_readme_v2_run_table_is_the_results_files():
    """README's batch-1 summary of runs A-C: tau, tok/s, ms per step and the ratios to
    run A's V2 chain and to the same run's DDTree on V1 are the files'."""
    files = {"A": "e2e_h200_v2.json", "B": "e2e_h200_v1v2.json", "C": "e2e_h200_v1v2_b64.json"}
    res = {run: results_rows(name) for run, name in files.items()}
    rows = block_after(README, "run  method          engine      T    tau   tok/s   ms per step")
    assert len(rows) == 10
    for run, method, runner, _, t, tau, tok_s, ms, x_chain, x_v1 in rows:
        name = "chain" if method == "chain" else f"{method}-{'v2' if runner == 'V2,' else 'sync'}"
        r = row_at(res[run][name], float(t), 1)
        assert_tau_speed_step(r, tau, tok_s, ms, (run, name))
        chain = row_at(res["A"]["chain"], float(t), 1)
        assert x_chain == ("-" if run != "A" else f"{r['tok_per_s'] / chain['tok_per_s']:.2f}")
        v1 = res[run].get(f"{method}-sync")
        assert x_v1 == ("-" if v1 is None else
                        f"{r['tok_per_s'] / row_at(v1, float(t), 1)['tok_per_s']:.2f}")


def test_readme_four_prompt_batch_1_table_is_the_results_file():
    """README's batch-1 rows over the four prompts: tau, tok/s, ms per step and the
    ratio to the chain of the same temperature are e2e_h200_v2_fused.json's."""
    res = results_rows("e2e_h200_v2_fused.json")
    rows = block_after(README, "method          T    tau   tok/s   ms per step   x chain\n")
    assert len(rows) == 4
    for method, t, tau, tok_s, ms, x_chain in rows:
        r = row_at(res[method], float(t), 1)
        assert_tau_speed_step(r, tau, tok_s, ms, (method, t))
        chain = row_at(res["chain"], float(t), 1)
        assert x_chain == f"{r['tok_per_s'] / chain['tok_per_s']:.2f}", (method, t)


def test_readme_four_runs_table_is_the_results_files():
    """README's T=0 batch-1 rows of the four 6506348 runs: tau, tok/s, ms per step and
    the ratio to the chain of the same run are e2e_h200_6506348_<run>.json's, and every
    method of every run is there."""
    runs = {run: results_rows(f"e2e_h200_6506348_{run}.json") for run in "1234"}
    rows = block_after(README, "run  method            tau   tok/s   ms per step   x chain\n")
    assert {(run, method) for run, method, *_ in rows} == {
        (run, method) for run, res in runs.items() for method in res}
    for run, method, tau, tok_s, ms, x_chain in rows:
        r = greedy(runs[run][method], 1)
        assert_tau_speed_step(r, tau, tok_s, ms, (run, method))
        chain = greedy(runs[run]["chain"], 1)
        assert x_chain == f"{r['tok_per_s'] / chain['tok_per_s']:.2f}", (run, method)


def test_readme_tree_attention_table_is_the_results_file():
    """README.md's tree-attention rows and its count of sizes within 1.2x of
    FlashAttention 3 (the faster of tree and split) are the file it names."""
    name = re.search(r"benchmarks/results/(tree_attention_split_h200_\w+\.json)", README)[1]
    results = {(r["context"], r["batch"], r["budget"]): r for r in results_rows(name)}
    rows = block_after(README, "   ctx batch    B   tree ms  split ms    fa3 ms tree/fa3")
    assert len(rows) >= 8
    for ctx, batch, budget, *cells in rows:
        r = results[int(ctx), int(batch), int(budget)]
        assert cells == [f"{r['tree_ms']:.4f}", f"{r['split_ms']:.4f}", f"{r['fa3_ms']:.4f}",
                         f"{r['tree_ms'] / r['fa3_ms']:.2f}", f"{r['split_ms'] / r['fa3_ms']:.2f}"]
    within = sum(min(r["tree_ms"], r["split_ms"]) <= 1.2 * r["fa3_ms"] for r in results.values())
    claimed = re.search(r"within the 1\.2x target on \*\*(\d+) of (\d+)\*\*", README)
    assert (int(claimed[1]), int(claimed[2])) == (within, len(results))


def test_bench_readme_key_lists_table_is_the_results_file():
    """benchmarks/README.md's key-list A/B rows and its 48-against-46 count are the
    two tables of the file it names (split ms, new and old, and their ratio)."""
    runs = json.loads((RESULTS / "tree_attention_key_lists_ab_h200.json").read_text())["runs"]
    tables = {name: {(r["context"], r["batch"], r["budget"]): r for r in run["results"]}
              for name, run in runs.items()}
    rows = block_after(BENCH_README, "   ctx batch    B      new      old   new/old")
    assert len(rows) >= 6
    for ctx, batch, budget, new, old, ratio in rows:
        n, o = (tables[t][int(ctx), int(batch), int(budget)]["split_ms"] for t in ("new", "old"))
        assert [new, old, ratio] == [f"{n:.4f}", f"{o:.4f}", f"{n / o:.2f}"]
    within = {t: sum(r["best_over_fa3"] <= 1.2 for r in table.values())
              for t, table in tables.items()}
    assert f"within 1.2x of FA3: {within['new']} of 48 against {within['old']}" in (
        " ".join(BENCH_README.split()))


def test_readme_interleaved_runs_table_is_the_results_files():
    """README's batch-1 rows of the two interleaved runs: tau, tok/s, ms per step and
    the ratio to the chain of the same run and temperature are
    e2e_h200_interleave_<run>.json's, every method of both runs at both temperatures."""
    files = {run: json.loads((RESULTS / f"e2e_h200_interleave_{run}.json").read_text())
             for run in "12"}
    assert all(f["interleaved"] for f in files.values())
    runs = {run: f["results"] for run, f in files.items()}
    rows = block_after(README, "run  method          T    tau   tok/s   ms per step   x chain\n1 ")
    assert {(run, method, t) for run, method, t, *_ in rows} == {
        (run, method, t) for run, res in runs.items() for method in res for t in "01"}
    for run, method, t, tau, tok_s, ms, x_chain in rows:
        r = row_at(runs[run][method], float(t), 1)
        assert_tau_speed_step(r, tau, tok_s, ms, (run, method, t))
        chain = row_at(runs[run]["chain"], float(t), 1)
        assert x_chain == f"{r['tok_per_s'] / chain['tok_per_s']:.2f}", (run, method, t)


def test_readme_step_graphs_table_is_the_results_file():
    """README's batch-1 rows of the step-graphs run: tau, tok/s, ms per step and the
    ratio to the chain of the same temperature are e2e_h200_stepgraphs.json's."""
    res = results_rows("e2e_h200_stepgraphs.json")
    heading, rows = block_after_file(README, "e2e_h200_stepgraphs.json")
    assert heading == "method T tau tok/s ms per step x chain".split()
    assert {(method, t) for method, t, *_ in rows} == {(m, t) for m in res for t in "01"}
    for method, t, tau, tok_s, ms, x_chain in rows:
        r, chain = row_at(res[method], float(t), 1), row_at(res["chain"], float(t), 1)
        assert_tau_speed_step(r, tau, tok_s, ms, (method, t))
        assert x_chain == f"{r['tok_per_s'] / chain['tok_per_s']:.2f}", (method, t)


def round_ratios(name: str, method: str) -> list[float]:
    """Chain seconds over ``method``'s, round by round (T=0, batch 1) of an interleaved run."""
    res = results_rows(name)
    chain, other = row_at(res["chain"], 0.0, 1), row_at(res[method], 0.0, 1)
    return [c / o for c, o in zip(chain["seconds_each"], other["seconds_each"], strict=True)]


def test_step_graphs_run_claims_are_the_results_files():
    """The prose around the step-graphs run: the round-by-round ranges, the step costs
    before and after, and tau equal to 7c0386e's run 1 in every row."""
    name = "e2e_h200_stepgraphs.json"
    ranges = {m: round_ratios(name, m) for m in ("ddtree-b32-k4", "ddtree-b16-k4")}
    said = re.search(r"the B = 32 ratio ranged ([\d.]+)-([\d.]+)\s+and B = 16's "
                     r"([\d.]+)-([\d.]+)", BENCH_README)
    assert said, "the round-by-round ranges are missing"
    want = [f"{f(r):.2f}" for r in ranges.values() for f in (min, max)]
    assert list(said.groups()) == want
    overall = [r for rs in ranges.values() for r in rs]
    found = re.search(r"ratio spread ([\d.]+)-([\d.]+)x", README)
    assert found and found.groups() == (f"{min(overall):.2f}", f"{max(overall):.2f}")
    before, after = results_rows("e2e_h200_interleave_1.json"), results_rows(name)
    for method in after:
        for t in (0.0, 1.0):
            for batch in (1, 8):
                assert round(row_at(after[method], t, batch)["tau"], 2) == round(
                    row_at(before[method], t, batch)["tau"], 2), (method, t, batch)


def test_readme_graph_coverage_ratios_are_the_results_files():
    """The current-limits note's batch-8 ratios (budget 64 without graphs, budget 16
    with them) are the interleaved runs' T=0 rows."""
    quoted = re.search(r"ran at ([\d.]+)x the chain's tokens/s, against\s+([\d.]+)x for "
                       r"budget 16 at batch 8", README)
    assert quoted, "the graph-coverage note is missing"
    for value, run, method in zip(quoted.groups(), "21", ("ddtree-b64-k4", "ddtree-b16-k4")):
        res = results_rows(f"e2e_h200_interleave_{run}.json")
        ratio = greedy(res[method], 8)["tok_per_s"] / greedy(res["chain"], 8)["tok_per_s"]
        assert value == f"{ratio:.2f}", method


POOLED = "e2e_h200_stepgraphs_pooled.json"
LATEST_POOLED = "e2e_h200_b89fd64_pooled.json"
POOL_HEADING = "method               T batch runs rounds  median"


def pooled_table_after(doc: str, name: str) -> list[list[str]]:
    """Rows of the first pooled table (--pool's heading) after ``results/<name>``."""
    start = doc.index(f"results/{name}")
    return block_after(doc[start:], POOL_HEADING)


@pytest.mark.parametrize("name", [POOLED, LATEST_POOLED])
def test_pooled_runs_are_what_pool_computes_from_their_files(name, tmp_path, monkeypatch):
    """A pooled file is bench_e2e's --pool of the files it names (so a re-run or an
    edited input shows), and both READMEs' pooled tables are its rows as --pool prints
    them."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_e2e

    saved = json.loads((RESULTS / name).read_text())
    monkeypatch.chdir(RESULTS)  # the file names its inputs relative to benchmarks/results
    again = bench_e2e.pool([Path(f) for f in saved["files"]], tmp_path / "p.json",
                           saved["target"])
    assert json.loads((tmp_path / "p.json").read_text()) == saved
    for doc in (README, BENCH_README):
        rows = pooled_table_after(doc, name)
        assert len(rows) == len(again["rows"])
        for cells, r in zip(rows, again["rows"], strict=True):
            want = [r["method"], f"{r['temperature']:.1f}", str(r["batch"]),
                    str(len(r["runs"])), str(r["rounds"]), f"{r['median']:.2f}",
                    "%.2f-%.2f" % tuple(r["interval_90"]), "%.2f-%.2f" % (r["min"], r["max"]),
                    f"{r['share_at_target']:.0%}", *(f"{run['median']:.2f}" for run in r["runs"])]
            assert cells == want


def test_pooled_run_claims_are_the_results_files():
    """README's summary of the step-graph runs: the pooled T=0 batch-1 medians, budget
    16's run medians and interval, and the verify-step costs (ms and ratio to the chain
    of the same run) it quotes."""
    rows = {(r["method"], r["temperature"], r["batch"]): r
            for r in json.loads((RESULTS / POOLED).read_text())["rows"]}
    b16, b32 = rows["ddtree-b16-k4", 0.0, 1], rows["ddtree-b32-k4", 0.0, 1]
    text = " ".join(README.split())
    assert (f"are {b16['median']:.2f}x the chain's at budget 16 and {b32['median']:.2f}x "
            "at budget 32") in text
    run_medians = [run["median"] for run in b16["runs"]]
    assert f"own median {min(run_medians):.2f}-{max(run_medians):.2f}x at budget 16" in text
    assert "budget 16's 90% interval ({:.2f}-{:.2f}x)".format(*b16["interval_90"]) in text
    ms, ratio = {}, {}
    for name in ("e2e_h200_stepgraphs.json", *(f"e2e_h200_17379b3_{i}.json" for i in "123")):
        res = results_rows(name)
        step = {m: 1000 * greedy(rows_, 1)["seconds"] / greedy(rows_, 1)["steps"]
                for m, rows_ in res.items()}
        for method, value in step.items():
            ms.setdefault((method, name.startswith("e2e_h200_17379b3")), []).append(value)
            if method != "chain":
                ratio.setdefault(method, []).append(value / step["chain"])
    every = [x for r in ratio.values() for x in r]
    ddtree_ms = [x for (m, _), v in ms.items() if m != "chain" for x in v]
    chain_ms = [x for (m, _), v in ms.items() if m == "chain" for x in v]
    assert (f"costs {min(every):.2f}-{max(every):.2f}x the chain's ({min(ddtree_ms):.1f}-"
            f"{max(ddtree_ms):.1f} ms against {min(chain_ms):.1f}-{max(chain_ms):.1f})") in text
    later = {m: v for (m, new), v in ms.items() if new}
    assert (f"it took {min(later['ddtree-b16-k4']):.2f}-{max(later['ddtree-b16-k4']):.2f} ms "
            f"(budget 16) and {min(later['ddtree-b32-k4']):.2f}-{max(later['ddtree-b32-k4']):.2f} "
            f"ms (budget 32) per verify step against the chain's "
            f"{min(later['chain']):.2f}-{max(later['chain']):.2f}") in text
    bench_text = " ".join(BENCH_README.split())
    for method, budget in (("ddtree-b16-k4", 16), ("ddtree-b32-k4", 32)):
        r = ratio[method]
        assert f"{min(r):.2f}-{max(r):.2f}x the chain's at budget {budget}" in bench_text or (
            f"{min(r):.2f}-{max(r):.2f}x at budget {budget}" in bench_text), method


LATEST_RUNS = ("e2e_h200_b89fd64.json", "e2e_h200_b89fd64_2.json")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}


def test_readme_trimmed_host_work_table_is_the_results_files():
    """README's batch-1 rows of the b89fd64 runs: tau, tok/s, ms per step (two
    decimals) and the ratio to the chain of the same run and temperature."""
    runs = {str(i): results_rows(name) for i, name in enumerate(LATEST_RUNS, start=1)}
    rows = block_after(README, "run  method            T    tau   tok/s   ms per step   x chain")
    assert {(run, method, t) for run, method, t, *_ in rows} == {
        (run, method, t) for run, res in runs.items() for method in res for t in "01"}
    for run, method, t, tau, tok_s, ms, x_chain in rows:
        r, chain = row_at(runs[run][method], float(t), 1), row_at(runs[run]["chain"], float(t), 1)
        assert float(tau) == round(r["tau"], 2) and int(tok_s) == round(r["tok_per_s"])
        assert ms == f"{1000 * r['seconds'] / r['steps']:.2f}", (run, method, t)
        assert x_chain == f"{r['tok_per_s'] / chain['tok_per_s']:.2f}", (run, method, t)


def test_where_it_stands_is_the_latest_runs():
    """The summary at the head of README's real-pair section (and benchmarks/README's
    reading of the same runs): step-cost ratios and times, tau and its ratio, and the
    pooled medians, run medians, interval and share of rounds at 1.3x."""
    method = "ddtree-b16-knone"
    runs = [results_rows(name) for name in LATEST_RUNS]
    pooled = {(r["method"], r["temperature"], r["batch"]): r
              for r in json.loads((RESULTS / LATEST_POOLED).read_text())["rows"]}
    b1 = pooled[method, 0.0, 1]

    def ms(res, m):
        r = greedy(res[m], 1)
        return 1000 * r["seconds"] / r["steps"]

    step_ratio = [ms(res, method) / ms(res, "chain") for res in runs]
    ddtree_ms, chain_ms = [ms(res, method) for res in runs], [ms(res, "chain") for res in runs]
    taus = {round(greedy(res[m], 1)["tau"], 2) for res in runs for m in (method, "chain")}
    tau, chain_tau = greedy(runs[0][method], 1)["tau"], greedy(runs[0]["chain"], 1)["tau"]
    assert taus == {round(tau, 2), round(chain_tau, 2)}  # the same in both runs
    medians = [run["median"] for run in b1["runs"]]
    text = " ".join(README.split())
    said = (
        f"a DDTree step costs {min(step_ratio):.2f}-{max(step_ratio):.2f}x the chain's "
        f"({min(ddtree_ms):.2f}-{max(ddtree_ms):.2f} ms against "
        f"{min(chain_ms):.2f}-{max(chain_ms):.2f})",
        f"commits {tau / chain_tau:.2f}x the chain's tokens per step at T=0 (tau {tau:.2f} "
        f"against {chain_tau:.2f})",
        f"its tokens/s are {b1['median']:.2f}x the chain's: the median of {b1['rounds']} "
        f"paired rounds over {NUMBER_WORDS[len(b1['runs'])]} runs",
        "run medians {:.2f}x and {:.2f}x, 90% interval {:.2f}-{:.2f}x, {:.0%} of rounds at "
        "1.3x or more".format(*medians, *b1["interval_90"], b1["share_at_target"]),
        f"At T=1, batch 1, the same runs give {pooled[method, 1.0, 1]['median']:.2f}x; at "
        f"batch 8, {pooled[method, 0.0, 8]['median']:.2f}x (T=0) and "
        f"{pooled[method, 1.0, 8]['median']:.2f}x (T=1)",
    )
    for phrase in said:
        assert phrase in text, phrase
    assert b1["median"] >= 1.3 and "The 1.3x target is met." in text
    bench = " ".join(BENCH_README.split())
    assert (f"costs {step_ratio[0]:.2f}x and {step_ratio[1]:.2f}x the chain's "
            f"({ddtree_ms[0]:.2f} against {chain_ms[0]:.2f} ms, {ddtree_ms[1]:.2f} against "
            f"{chain_ms[1]:.2f};") in bench
