"""Render the results tables of the docs from benchmarks/results/*.json.

Every table of figures in README.md and docs/*.md sits between two markers,

    <!-- results:NAME -->
    ...generated markdown...
    <!-- /results:NAME -->

and NAME picks a function of RENDERERS below, which reads the named results files and
returns the markdown. Figures in the docs therefore come from the files, never by hand.

    python benchmarks/render_docs.py           # rewrite every block in place
    python benchmarks/render_docs.py --check   # name stale or unknown blocks, write nothing
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import prompt_sets  # benchmarks/, beside this script
import serving_summary

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
# Markers start their own lines; a block's body is everything between them.
BLOCK = re.compile(r"^(<!-- results:([\w-]+) -->\n)(.*?)^(<!-- /results:\2 -->)$",
                   re.DOTALL | re.MULTILINE)
OPENING = re.compile(r"<!-- results:([\w-]+) -->")

# The current runs of record, one per benchmark.
E2E_POOLED = "e2e_h200_b89fd64_pooled.json"
E2E_CPU = "e2e_cpu_caps.json"
E2E_TP2 = "e2e_h200x2_tp2_tiny.json"
GRAPH_COVERAGE = ("e2e_h200_interleave_2.json", "e2e_h200_interleave_1.json")
GPU_STEP = "gpu_step_20261202_9d08fc0_v2.json"
# Step cost by batch up to 64 and by tree size (the load question), one H200 session.
GPU_STEP_KIMI = "gpu_step_kimi_h200.json"
GPU_STEP_LOAD = ("gpu_step_h200_v2_load.json", "gpu_step_h200_v2_small_trees.json")
# The real pair's tau on the benchmark sets with the block-16 drafter (the 8B shape's
# drafter is block 16, so the chain's 16 rows are priced as it verifies them), for the
# 8B-shaped projection: bench_serving.py's counted passes, by method.
PROJECTION_TAU = ("drafter_cpu_tau_b16.json", "drafter_cpu_tau_b16_small.json")
# MT-Bench on the CPU with the real pair: fixed trees against trees sized per step.
SERVING_CPU = "serving_cpu_mtbench.json"
# bench_serving.py --summarize over the H100 runs of one plan (the first file's settings).
SERVING_H100 = "serving_h100_offline_mtbench.json"
# The same over both prompt sets, with the block-16 drafter and the chain's schedule.
SERVING_H100_B16 = "serving_h100_offline_b16.json"
# The OpenAI server under load (bench_serving.py --mode serve), one detached run.
SERVING_SERVE = "serving_h100_serve_sizer.json"
DRAFTERS_CPU = {"b8": ("drafter_cpu_tau_b8.json",),
                "b16": ("drafter_cpu_tau_b16.json", "drafter_cpu_tau_b16_small.json")}
TREE_ATTENTION = "tree_attention_split_h200_683208e.json"
TREE_OPS = ("tree_ops_preorder_fused_ab_h200.json", "fused")
PROFILE = "gpu_profile_20261204_cb12350_real.json"
# The OpenAI server soak on the GPU (soak_server.py).
# Each GPU soak and the card it ran on (the reports do not name it).
SOAK_GPU = (("soak_h100.json", "H100"), ("soak_h200_bf16.json", "H200"))
# The MLA tree kernel against TRITON_MLA's decode kernel (bench_mla_attention.py).
MLA_ATTENTION = "mla_attention_h100.json"
# Tilings tried for it at budgets 16-512, one run beside the tiling it had before.
MLA_TILINGS = "mla_attention_h100_tilings.json"


class Doc:
    """The document a block is rendered into: links are relative to its folder."""

    def __init__(self, path: Path) -> None:
        self.dir = path.parent

    def link(self, name: str, text: str | None = None) -> str:
        """A markdown link to ``benchmarks/results/<name>``."""
        target = os.path.relpath(RESULTS / name, self.dir).replace(os.sep, "/")
        return f"[{text or name}]({target})"


Renderer = Callable[[Doc], str]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        RENDERERS[name] = fn
        return fn

    return register


# --- reading results files ---------------------------------------------------------


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def row_at(rows: list[dict], temperature: float, batch: int) -> dict:
    return next(r for r in rows if r["temperature"] == temperature and r["batch"] == batch)


def method_label(name: str) -> str:
    """``ddtree-b16-knone`` -> ``DDTree B=16, no cap``; ``ddtree-b16-k4`` -> ``... cap 4``."""
    found = re.fullmatch(r"ddtree-b(\d+)-k(\w+?)(-.*)?", name)
    if not found:
        return name
    budget, cap, rest = found.groups()
    cap_text = "no cap" if cap == "none" else f"cap {cap}"
    return f"DDTree B={budget}, {cap_text}{rest or ''}"


def table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    """A pipe table; ``align`` holds one of l/r per column (default: first l, rest r)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def x(value: float) -> str:
    return f"{value:.2f}x"


def span(values: list[float], fmt: str = "{:.2f}") -> str:
    """One value if they agree at this precision, else low-high."""
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


def run_setup(run: dict) -> str:
    """One line on how an e2e run was made, from its own fields."""
    parts = [run["dtype"], "CUDA graphs" if run.get("graphs") else "eager",
             f"{run['max_tokens']} new tokens per request"]
    if run.get("tensor_parallel_size", 1) > 1:
        parts.append(f"tensor parallelism {run['tensor_parallel_size']}")
    if run.get("interleaved"):
        parts.append("all engines alive, timed in turn")
    return ", ".join(parts)


# --- end to end (bench_e2e.py) -----------------------------------------------------


def pooled_inputs() -> tuple[dict, list[dict]]:
    pooled = load(E2E_POOLED)
    return pooled, [load(name) for name in pooled["files"]]


@renderer("readme-h200")
def readme_h200(doc: Doc) -> str:
    """README's one table: the real pair on the H200, DDTree's tokens/s over the chain's
    round by round (median and interval over the pooled runs), and both taus."""
    pooled, runs = pooled_inputs()
    rows = []
    for r in pooled["rows"]:
        key = (r["temperature"], r["batch"])
        taus = {m: [row_at(run["results"][m], *key)["tau"] for run in runs]
                for m in ("chain", r["method"])}
        rows.append([f"{r['temperature']:g}", str(r["batch"]), span(taus["chain"]),
                     span(taus[r["method"]]), f"**{x(r['median'])}**",
                     "-".join(x(v) for v in r["interval_90"]),
                     f"{r['rounds']} ({len(r['runs'])})"])
    methods = sorted({method_label(r["method"]) for r in pooled["rows"]})
    return "\n".join([
        table(["T", "batch", "tau, chain", "tau, DDTree", "tokens/s, DDTree ÷ chain (median)",
               "90% interval", "rounds (runs)"], rows, "rrrrrrr"),
        "",
        (f"One H200, SmolLM2-135M-Instruct and its trained DFlash drafter: "
         f"{'; '.join(methods)}, against vLLM's DFlash chain on the same drafter; "
         f"{run_setup(runs[0])}. tau: tokens committed per verify step. "
         f"Source: {doc.link(E2E_POOLED, 'pooled results')}."),
    ])


@renderer("e2e-h200-pooled")
def e2e_h200_pooled(doc: Doc) -> str:
    """Everything ``bench_e2e.py --pool`` computes, per row."""
    pooled, runs = pooled_inputs()
    target = pooled["target"]
    rows = [[method_label(r["method"]), f"{r['temperature']:g}", str(r["batch"]),
             f"{len(r['runs'])} / {r['rounds']}", x(r["median"]),
             "-".join(x(v) for v in r["interval_90"]), f"{x(r['min'])}-{x(r['max'])}",
             f"{r['share_at_target']:.0%}", ", ".join(x(run["median"]) for run in r["runs"])]
            for r in pooled["rows"]]
    return "\n".join([
        table(["method", "T", "batch", "runs / rounds", "median", "90% interval", "range",
               f"rounds ≥ {target:g}x", "run medians"], rows),
        "",
        (f"Each round: DDTree's tokens/s over the chain's in the same round "
         f"({run_setup(runs[0])}). Source: {doc.link(E2E_POOLED)}, pooled from "
         + ", ".join(doc.link(name) for name in pooled["files"]) + "."),
    ])


@renderer("e2e-h200-runs")
def e2e_h200_runs(doc: Doc) -> str:
    """The pooled runs one by one: tau, tokens/s and (batch 1) ms per verify step."""
    pooled, runs = pooled_inputs()
    rows = []
    for number, run in enumerate(runs, start=1):
        chain = run["results"]["chain"]
        for method, results in run["results"].items():
            for r in results:
                base = row_at(chain, r["temperature"], r["batch"])
                step = (f"{1000 * r['seconds'] / r['steps']:.2f}"
                        if r["batch"] == 1 and r["steps"] else "-")
                rows.append([str(number), method_label(method), f"{r['temperature']:g}",
                             str(r["batch"]), f"{r['tau']:.2f}", f"{r['tok_per_s']:.0f}",
                             step, x(r["tok_per_s"] / base["tok_per_s"])])
    return "\n".join([
        table(["run", "method", "T", "batch", "tau", "tokens/s", "ms per verify step",
               "÷ chain"], rows, "lrrrrrrr"),
        "",
        "tokens/s: the median timed round; ms per verify step at batch 1 (the four prompts "
        "one at a time). Sources: " + ", ".join(doc.link(n) for n in pooled["files"]) + ".",
    ])


@renderer("e2e-cpu")
def e2e_cpu(doc: Doc) -> str:
    """tau by budget and top-k cap on the CPU, float32."""
    run = load(E2E_CPU)
    keys = [(0.0, 1), (0.0, 8), (1.0, 1), (1.0, 8)]
    rows = [[method_label(m), *(f"{row_at(res, *k)['tau']:.2f}" for k in keys)]
            for m, res in run["results"].items()]
    return "\n".join([
        table(["method", "tau, T=0, batch 1", "T=0, batch 8", "T=1, batch 1", "T=1, batch 8"],
              rows),
        "",
        (f"SmolLM2-135M-Instruct and its drafter on a CPU, {run_setup(run)}. "
         f"Source: {doc.link(E2E_CPU)}."),
    ])


@renderer("e2e-tp2")
def e2e_tp2(doc: Doc) -> str:
    """Two GPUs, tensor parallelism 2, tiny random pair: what speculation costs there."""
    run = load(E2E_TP2)
    res = run["results"]
    rows = []
    for batch in sorted({r["batch"] for r in res["plain"]}):
        plain, chain = row_at(res["plain"], 0.0, batch), row_at(res["chain"], 0.0, batch)
        for method, results in res.items():
            r = row_at(results, 0.0, batch)
            rows.append([method_label(method), str(batch), f"{r['tau']:.2f}",
                         f"{r['tok_per_s']:.0f}", x(r["tok_per_s"] / plain["tok_per_s"]),
                         x(r["tok_per_s"] / chain["tok_per_s"])])
    return "\n".join([
        table(["method", "batch", "tau", "tokens/s", "÷ plain", "÷ chain"], rows),
        "",
        (f"Two H200s, T=0, {run_setup(run)}, custom all-reduce "
         f"{'on' if run.get('custom_all_reduce') else 'off'}. "
         f"Source: {doc.link(E2E_TP2)}."),
    ])


@renderer("graph-coverage")
def graph_coverage(doc: Doc) -> str:
    """Batch 8 at T=0 by budget: rows per verify step against DDTree's speed."""
    rows = []
    for name in GRAPH_COVERAGE:
        res = load(name)["results"]
        chain = row_at(res["chain"], 0.0, 8)
        for method, results in res.items():
            found = re.match(r"ddtree-b(\d+)", method)
            if not found:
                continue
            r = row_at(results, 0.0, 8)
            rows.append((int(found[1]), [method_label(method), str(8 * (int(found[1]) + 1)),
                                         f"{r['tau']:.2f}", f"{chain['tau']:.2f}",
                                         x(r["tok_per_s"] / chain["tok_per_s"])]))
    return "\n".join([
        table(["method", "rows per verify step at batch 8", "tau", "tau, chain",
               "tokens/s ÷ chain"], [cells for _, cells in sorted(rows)]),
        "",
        "Real pair, H200, T=0, batch 8, an earlier version of the step than the tables "
        "above. Sources: " + ", ".join(doc.link(n) for n in GRAPH_COVERAGE) + ".",
    ])


# --- step cost, kernels and profile --------------------------------------------------


@renderer("gpu-step")
def gpu_step(doc: Doc) -> str:
    """ms per decode step by method and batch, and the plugin's own share of it."""
    data = load(GPU_STEP)
    runs = data["runs"]
    batches = sorted({row["batch"] for run in runs for row in run["rows"]})
    ms = {(run["method"], row["batch"]): row["ms_per_step"] for run in runs for row in run["rows"]}
    rows = []
    for run in runs:
        name = run["method"] + (f" B={run['budget']}" if run.get("budget") else "")
        cells = [f"{ms[run['method'], b]:.3f}" for b in batches]
        cells += [x(ms[run["method"], b] / ms["chain", b]) for b in batches]
        rows.append([f"{name} ({run['runner']})", *cells])
    steps = table(["method (runner)", *(f"ms, batch {b}" for b in batches),
                   *(f"÷ chain, batch {b}" for b in batches)], rows)
    ops = [[str(o["batch"]), str(o["budget"]), f"{o['ddtree_step_ms']:.3f}",
            f"{o['ops_engine_ms']:.3f}", f"{o['share_engine_pct']:.1f}%",
            f"{o['ops_graph_ms']:.3f}"] for o in data["tree_ops"]]
    share = table(["batch", "budget", "DDTree step, ms", "tree build + walk + compaction, ms",
                   "share of the step", "the same as one CUDA graph, ms"], ops)
    args = data["arguments"]
    return "\n".join([
        steps, "", share, "",
        (f"vLLM {data['environment']['vllm']} on an H200, Qwen3-8B-shaped target with dummy "
         f"weights, prompts of {args['prompt_len']} tokens, bf16, CUDA graphs; nothing is "
         f"accepted, so these are costs per step. Source: {doc.link(GPU_STEP)}."),
    ])


@renderer("gpu-step-kimi")
def gpu_step_kimi(doc: Doc) -> str:
    """The Kimi K2.6-shaped step: ms per step by method and batch, ÷ plain and ÷ chain."""
    data = load(GPU_STEP_KIMI)
    runs = data["runs"]
    rows = []
    for run in runs:  # the ratios as bench_gpu_step wrote them (same runner and batch)
        name = run["method"] + (f" B={run['budget']}" if run.get("budget") else "")
        rows += [[name, str(row["batch"]), f"{row['ms_per_step']:.2f}", x(row["x_plain"]),
                  x(row["x_chain"])] for row in run["rows"]]
    args, env = data["arguments"], data["environment"]
    merged_note = "".join(f" The {run['method']} rows come from {run['merged_from']}."
                          for run in runs if run.get("merged_from"))
    return "\n".join([
        table(["method", "batch", "ms/step", "÷ plain", "÷ chain"], rows, "lrrrr"),
        "",
        (f"vLLM {env['vllm']}, {env['gpu'].split(',')[0]}, Kimi K2.6's text model at full "
         f"width cut to 1 dense + {args['moe_layers']} MoE layers, dummy weights, bf16, "
         f"V2 runner, CUDA graphs, prompts of {args['prompt_len']} tokens; "
         f"{args['long_len'] - args['short_len']}-step differences, "
         f"{args['repeats']} repeats (median). Nothing is accepted, so these are costs per "
         "step. The drafter (6 full-width layers) is fixed per step while the cut target "
         f"has {args['moe_layers'] + 1} of Kimi's 61 layers, so the ratios to plain decoding overstate what the "
         f"full model would see.{merged_note} Source: {doc.link(GPU_STEP_KIMI)}."),
    ])


@renderer("gpu-step-load")
def gpu_step_load(doc: Doc) -> str:
    """ms per step by batch up to 64 for plain decoding, the chain and DDTree at several
    budgets, with what each step costs over plain decoding: the tokens per step (tau) a
    method must commit to break even with it."""
    runs = [run for name in GPU_STEP_LOAD for run in load(name)["runs"] if not run["error"]]
    ms = {(run["method"], run.get("budget"), row["batch"]): row["ms_per_step"]
          for run in runs for row in run["rows"]}
    batches = sorted({b for _, _, b in ms})
    order = sorted({(m, b) for m, b, _ in ms}, key=lambda k: (
        ["plain", "chain", "ddtree"].index(k[0]), k[1] or 0))
    rows = []
    for method, budget in order:
        spec = next(run["speculative_config"] for run in runs
                    if run["method"] == method and run.get("budget") == budget)
        spec = spec or {}  # verify rows per request: drafts sent + the root
        width = 1 + spec.get("ddtree_budget", spec.get("num_speculative_tokens", 0))
        name = method + (f" B={budget}" if budget else "")
        cells = [f"{ms[method, budget, b]:.2f}" for b in batches]
        cells += [f"{ms[method, budget, b] / ms['plain', None, b]:.2f}" for b in batches]
        capture = {run["engine"]["max_cudagraph_capture_size"] for run in runs
                   if run["method"] == method and run.get("budget") == budget}
        rows.append([name, str(width), *cells,
                     ", ".join(map(str, sorted(capture)))])
    header = ["method", "rows per request", *(f"ms, batch {b}" for b in batches),
              *(f"break-even tau, batch {b}" for b in batches), "graphs up to (rows)"]
    data = load(GPU_STEP_LOAD[0])
    args = data["arguments"]
    links = ", ".join(doc.link(name) for name in GPU_STEP_LOAD)
    return "\n".join([
        table(header, rows), "",
        (f"vLLM {data['environment']['vllm']}, V2 runner, on an H200: Qwen3-8B-shaped target "
         f"with dummy weights, prompts of {args['prompt_len']} tokens, bf16, CUDA graphs "
         "sized by the benchmark to cover every batch measured; one round. Break-even tau "
         "is the step's cost over plain decoding's: the tokens a step must commit to match "
         f"plain decoding's speed. The chain verifies block-size rows (16). Sources: {links}."),
    ])


@renderer("projection-8b")
def projection_8b(doc: Doc) -> str:
    """A projection, not a measurement: the real pair's tau on each benchmark set over
    the 8B-shaped step costs, as speed relative to plain decoding, and the best of the
    tree sizes (or none) per batch."""
    runs = [run for name in GPU_STEP_LOAD for run in load(name)["runs"] if not run["error"]]
    ms = {(run["method"], run.get("budget"), row["batch"]): row["ms_per_step"]
          for run in runs for row in run["rows"]}
    batches = sorted({b for _, _, b in ms})
    tau = {(t["set"], t["method"]): t["tau"]
           for name in PROJECTION_TAU for t in load(name)["tau"]}
    budgets = sorted({k for (m, k, _) in ms if m == "ddtree" and any(
        method == f"ddtree{k}" for _, method in tau)})
    methods = [("chain", "chain", None)] + [(f"DDTree B={k}", "ddtree", k) for k in budgets]

    def key(method: str, budget: int | None) -> str:
        return "chain" if method == "chain" else f"ddtree{budget}"

    def speed(sset: str, method: str, budget: int | None, batch: int) -> float:  # ÷ plain
        return tau[sset, key(method, budget)] * ms["plain", None, batch] / ms[
            method, budget, batch]

    rows = []
    for sset in sorted({s for s, _ in tau}):
        for label, method, budget in methods:
            rows.append([sset, label, f"{tau[sset, key(method, budget)]:.2f}",
                         *(x(speed(sset, method, budget, b)) for b in batches)])
        best = []
        for b in batches:
            sized = max([1.0] + [speed(sset, m, k, b) for _, m, k in methods[1:]])
            best.append(f"{x(sized)} ({x(sized / speed(sset, 'chain', None, b))} chain)")
        rows.append([sset, "best DDTree size or none, per batch", "-", *best])
    settings = load(PROJECTION_TAU[0])["settings"]
    sources = [*PROJECTION_TAU, *GPU_STEP_LOAD]
    return "\n".join([
        table(["set", "method", "tau (real pair)",
               *(f"÷ plain, batch {b}" for b in batches)], rows, "llr" + "r" * len(batches)),
        "",
        ("**A projection, not a measurement.** Speed relative to plain decoding = tau / "
         "(the step's cost over plain decoding's), with tau measured on the real pair "
         "(SmolLM2-135M and the block-16 drafter, vLLM on the CPU in float32, greedy, "
         f"batch {settings['batches'][0]}, {settings['max_tokens']} new tokens per request, "
         "the same prompts of each benchmark set for every method; no top-k cap) and the "
         "costs of the Qwen3-8B-shaped target above. The real pair's drafter and the 8B "
         "shape's are both block 16, so the chain's tau and its cost are both of 16-row "
         "steps. The best row is what sizing per step could reach "
         "with these sizes (none = plain decoding's speed; the sizer's size 0 still stores "
         "the drafter's context K/V). Sources: "
         + ", ".join(doc.link(n) for n in sources) + "."),
    ])


def serving_rows(summary: list[dict], tokens: str,
                 extra: Callable[[dict], list[str]] = lambda r: [],
                 chain: str = "vs_chain") -> list[list[str]]:
    """bench_serving.py's summary rows by batch and method: tau, tokens/s (``tokens``
    formats the median and the 90% interval's ends), the ratios to plain decoding and
    to ``chain`` (``vs_chain``, or ``vs_best_chain``: the faster chain) with intervals,
    then ``extra(row)``'s cells."""
    def ratio(cell: dict | None) -> str:
        if not cell:
            return "-"
        low, high = cell["interval_90"]
        return f"{x(cell['median'])} ({low:.2f}-{high:.2f})"

    rows = []
    for r in sorted(summary, key=lambda r: (r["load"], r["method"])):
        speed = r["tok_per_s"]
        low, high = speed["interval_90"]
        rows.append([str(r["load"]), r["method"], f"{r['tau']:.2f}" if r["tau"] else "-",
                     f"{speed['median']:{tokens}} ({low:{tokens}}-{high:{tokens}})",
                     ratio(r["vs_plain"]), ratio(r.get(chain)), *extra(r)])
    return rows


@renderer("serving-cpu")
def serving_cpu(doc: Doc) -> str:
    """bench_serving.py's offline table of one run: tokens/s and ratios with intervals."""
    data = load(SERVING_CPU)
    settings = data["settings"]
    rows = serving_rows(data["summary"], ".1f")
    return "\n".join([
        table(["batch", "method", "tau", "tokens/s (90% interval)", "÷ plain", "÷ chain"], rows,
              "rllrrr"),
        "",
        (f"Real pair (SmolLM2-135M and the b8 drafter), device {data['device']!r} (a 2-core "
         f"CPU), float32, MT-Bench (first turns, shuffled), {settings['max_tokens']} new tokens per "
         f"request, {settings['rounds']} timed rounds, engines one at a time (a round's ratios "
         "pair passes by round number). On a CPU a step's cost grows with its rows at once, so "
         "this is where a fixed tree loses most under load; the H200's costs are other. "
         "ddtree16-adaptive's tau counts only the steps that drafted (its steps of size 0 "
         f"verify no tree). Source: {doc.link(SERVING_CPU)}."),
    ])


@renderer("serving-h100")
def serving_h100(doc: Doc) -> str:
    """bench_serving.py's runs pooled (--summarize): tokens/s and ratios with intervals,
    and how many runs and rounds each row pools."""
    pooled = load(SERVING_H100)
    first = load(Path(pooled["files"][0]).name)
    settings = first["settings"]
    rows = serving_rows(pooled["rows"], ",.0f", lambda r: [f"{r['runs']} / {r['rounds']}"])
    sources = [SERVING_H100] + [Path(f).name for f in pooled["files"]]
    return "\n".join([
        table(["batch", "method", "tau", "tokens/s (90% interval)", "÷ plain", "÷ chain",
               "runs / rounds"], rows, "rllrrrr"),
        "",
        (f"Real pair (SmolLM2-135M and the b8 drafter), one lent H100, {settings['dtype']}, "
         f"CUDA graphs, V2 runner, MT-Bench (first turns, shuffled), "
         f"{settings['max_tokens']} new tokens per request, at least "
         f"{settings['min_prompts']} prompts a pass, every engine alive and timed in turn. "
         "Two calls on one machine pooled; the first call's time ran out in its third round, so "
         "batch 8 and above pool fewer rounds. ddtree16-adaptive is the tree sized per step "
         "(budget 16 the ceiling) before its sizer timed only steady steps. Sources: "
         + ", ".join(doc.link(n) for n in sources) + "."),
    ])


@renderer("serving-h100-b16")
def serving_h100_b16(doc: Doc) -> str:
    """bench_serving.py's pooled runs over HumanEval and MT-Bench: per set, tokens/s
    and the ratios to plain decoding and to the faster chain at each batch size."""
    pooled = load(SERVING_H100_B16)
    first = load(Path(pooled["files"][0]).name)
    settings = first["settings"]
    sources = [SERVING_H100_B16] + [Path(f).name for f in pooled["files"]]
    blocks = []
    for name in sorted({r["set"] for r in pooled["rows"]}):
        rows = serving_rows([r for r in pooled["rows"] if r["set"] == name], ",.0f",
                            lambda r: [f"{r['runs']} / {r['rounds']}"], "vs_best_chain")
        blocks += [f"**{name}**", "",
                   table(["batch", "method", "tau", "tokens/s (90% interval)", "÷ plain",
                          "÷ best chain", "runs / rounds"], rows, "rllrrrr"), ""]
    return "\n".join(blocks + [
        (f"Real pair (SmolLM2-135M and the block-16 drafter), one lent H100, "
         f"{settings['dtype']}, CUDA graphs, V2 runner, `max_num_seqs` "
         f"{settings['max_num_seqs']}, {settings['max_tokens']} new tokens per request, at "
         f"least {settings['min_prompts']} prompts a pass, every engine alive and timed in "
         "turn. \"best chain\" is the faster of the chain and chain-schedule (vLLM's "
         "batch-size schedule for the chain's draft length, this benchmark's default) at "
         "that batch size, within each round. Two calls on one machine pooled: the first "
         "started the engines from an empty compile cache and had time left for one "
         "HumanEval round (batch 1-16, and plain decoding at 32), the second timed four "
         "rounds and part of a fifth. Sources: " + ", ".join(doc.link(n) for n in sources) + "."),
    ])


def round_tpot_p99(data: dict, name: str, load: int, method: str) -> dict[int, float]:
    """TPOT p99 in ms of one method's pass in each round, by round."""
    return {r["round"]: 1000 * serving_summary.percentile(r["tpot_s"], 99)
            for r in data["rounds"] if (r["set"], r["load"], r["method"]) == (name, load, method)
            and r.get("tpot_s")}


def tpot_vs_best_chain(data: dict, row: dict) -> str:
    """A row's TPOT p99 over the faster chain's (by tokens/s) in the same round: the
    median ratio and its range over rounds."""
    name, load = row["set"], row["load"]
    passes = [r for r in data["rounds"] if (r["set"], r["load"]) == (name, load)]
    mine = round_tpot_p99(data, name, load, row["method"])
    ratios = []
    for index, p99 in sorted(mine.items()):
        chains = [r for r in passes if r["round"] == index
                  and serving_summary.is_chain(r["method"])]
        if chains:
            best = max(chains, key=lambda r: r["tok_per_s"])["method"]
            ratios.append(p99 / round_tpot_p99(data, name, load, best)[index])
    if not ratios:
        return "-"
    return f"{x(statistics.median(ratios))} ({min(ratios):.2f}-{max(ratios):.2f})"


@renderer("serving-serve")
def serving_serve(doc: Doc) -> str:
    """bench_serving.py's serve mode, one run: per prompt set and concurrency, tokens/s
    and its ratios with intervals, TTFT and TPOT percentiles over every request, and
    TPOT p99 against the faster chain's, round by round."""
    data = load(SERVING_SERVE)
    settings = data["settings"]
    rows = serving_summary.summarize([data])
    blocks = []
    for name in sorted({r["set"] for r in rows}):
        mine = [r for r in rows if r["set"] == name]
        cells = serving_rows(mine, ",.0f", lambda r: [
            f"{fmt_ms(r['ttft_ms'])}", f"{fmt_ms(r['tpot_ms'])}", tpot_vs_best_chain(data, r),
            str(r["errors"])], "vs_best_chain")
        blocks += [f"**{name}**", "",
                   table(["concurrency", "method", "tau", "tokens/s (90% interval)", "÷ plain",
                          "÷ best chain", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
                          "TPOT p99 ÷ best chain", "errors"], cells, "rllrrrrrrr"), ""]
    rounds = sorted({r["round"] for r in data["rounds"]})
    return "\n".join(blocks + [
        (f"Real pair (SmolLM2-135M and the {Path(data['drafter']).name} drafter), vLLM's "
         f"OpenAI server on one lent {data['device'].upper()}, {settings['dtype']}, CUDA "
         f"graphs, V2 runner, `max_num_seqs` {settings['max_num_seqs']}, "
         f"{settings['max_tokens']} new tokens per request, "
         f"{settings.get('per_slot', 2)} requests a pass per concurrent slot (at least "
         f"{settings['min_prompts']}), {len(rounds)} timed rounds, every "
         "server alive and loaded in turn by a streaming client. TTFT and TPOT are "
         "percentiles over every request of the row's rounds; \"TPOT p99 ÷ best chain\" "
         "pairs each round's p99 with that of the faster chain in the same round (median, "
         f"range over rounds). Source: {doc.link(SERVING_SERVE)}."),
    ])


def fmt_ms(cell: dict) -> str:
    return " / ".join("-" if cell[q] is None else f"{cell[q]:.1f}" for q in ("p50", "p99"))


def method_order(method: str) -> tuple[int, int]:
    """The chain first, then DDTree by budget (``ddtree<B>``)."""
    return (0, 0) if method == "chain" else (1, int(method.removeprefix("ddtree")))


@renderer("drafters-cpu")
def drafters_cpu(doc: Doc) -> str:
    """The shipped drafters' acceptance on the benchmark sets (bench_serving.py's
    counted pass per method and set): tau and acceptance by depth."""
    rows, settings = [], None
    for name, files in DRAFTERS_CPU.items():
        data = [load(file) for file in files]
        settings = data[0]["settings"]
        block = json.loads((ROOT / data[0]["drafter"] / "config.json").read_text())["block_size"]
        taus = [t for d in data for t in d["tau"]]
        for t in sorted(taus, key=lambda t: (t["set"], method_order(t["method"]))):
            depth = " ".join(f"{a:.2f}".lstrip("0") for a in t["accept_rate_per_depth"][:5])
            rows.append([name, str(block), t["set"], t["method"], f"{t['tau']:.2f}", depth])
    return "\n".join([
        table(["drafter", "block", "set", "method", "tau", "acceptance at depth 1-5"], rows,
              "lrllrl"),
        "",
        (f"vLLM on the CPU, {settings['dtype']}, greedy, batch {settings['batches'][0]}, the "
         f"same {prompt_sets.pass_size('offline', settings['batches'][0], settings['min_prompts'])}"
         " prompts of each set for every row (the sets shuffled as everywhere in "
         f"bench_serving.py), {settings['max_tokens']} new tokens per request; the chain "
         "drafts block size - 1 tokens, ddtree<B> verifies a tree of B nodes with no top-k cap. "
         "tau: tokens committed per verify step. Sources: "
         + ", ".join(doc.link(f) for files in DRAFTERS_CPU.values() for f in files) + "."),
    ])


@renderer("soak-gpu")
def soak_gpu(doc: Doc) -> str:
    """soak_server.py's levels on the GPU, one table per soak: requests, errors,
    latency, steps, and the plain server's comparison."""
    return "\n\n".join(soak_gpu_one(doc, name, card) for name, card in SOAK_GPU)


def soak_gpu_one(doc: Doc, name: str, card: str) -> str:
    data = load(name)
    # A replay's report keeps the soak's own configuration beside its own.
    config, ref = data.get("soak_config") or data["config"], data["reference"]
    args = config["server_args"]
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args else "auto"
    rows = []
    for level in data["levels"]:
        level_name = "long, one at a time" if level.get("phase") == "long" else str(
            level["concurrency"])
        rows.append([level_name, str(level["requests"]), str(level["ok"]),
                     str(level["cancelled"]), str(level["error"]), str(level["lost"]),
                     str(level["structured"]),
                     f"{level['latency_p50_s']:.2f} / {level['latency_p99_s']:.2f}",
                     f"{level['output_tokens_per_s']:.0f}",
                     f"{level['tokens_per_verify_step']:.2f}", str(level["engine_steps"]),
                     f"{level['kv_cache_usage_after']:g}", str(level["health_after"])])
    if ref is None:
        compared = "No plain server replayed its texts in this run (not compared)."
    else:
        t0 = f"T=0 {ref['t0'][1]}/{ref['t0'][0]} identical"
        if dtype != "float32":
            t0 += (f" (in {dtype} a rounding flip at a near tie sends a text elsewhere, so "
                   "these are counted, not required to match; float32 is the identity check)")
        compared = (f"A plain server with the same flags replayed them: {t0}, seeded "
                    f"{ref['seeded'][1]}/{ref['seeded'][0]} (a seed fixes the draws, and "
                    "speculation draws in another order than plain decoding, so seeded "
                    "texts may differ; each is still a sample of the target's "
                    "distribution).")
    spec = json.loads(config["speculative_config"])
    return "\n".join([
        f"**{card}, {dtype}**",
        "",
        table(["concurrency", "requests", "ok", "cancelled", "errors", "lost", "structured",
               "latency p50 / p99 s", "tokens/s", "tokens per step", "engine steps",
               "KV after", "/health after"], rows),
        "",
        (f"One DDTree server on an {card} (budget {spec['ddtree_budget']}, top-k cap "
         f"{spec.get('ddtree_topk_cap')}), the real pair, "
         f"{' '.join(args)}, V2 runner with CUDA graphs, "
         f"{data['engine_steps']} engine steps in all. {compared} "
         f"Source: {doc.link(name)}."),
    ])


def size_grid(results: list[dict],
              columns: list[tuple[str, Callable[[dict], str]]]) -> str:
    """An attention benchmark's sizes as a table: a row per (context, batch), the
    ``columns`` (name, cell of a result) once per budget."""
    by_size = {(r["context"], r["batch"], r["budget"]): r for r in results}
    budgets = sorted({k[2] for k in by_size})
    header = ["context", "batch", *(f"B={budget}: {name}" if i == 0 else name
                                    for budget in budgets
                                    for i, (name, _) in enumerate(columns))]
    rows = [[str(context), str(batch), *(cell(by_size[context, batch, budget])
                                         for budget in budgets for _, cell in columns)]
            for context, batch in sorted({k[:2] for k in by_size})]
    return table(header, rows)


@renderer("mla-attention")
def mla_attention(doc: Doc) -> str:
    """bench_mla_attention.py: the tree kernel's time over the decode kernel's, every size."""
    data = load(MLA_ATTENTION)
    grid = size_grid(data["results"], [("decode ms", lambda r: f"{r['decode_ms']:.3f}"),
                                       ("tree ÷ decode", lambda r: f"{r['ratio']:.2f}")])
    worst = max(r["max_abs_diff"] for r in data["results"])
    tilings = load(MLA_TILINGS)
    return "\n".join([
        grid,
        "",
        (f"The kernel's default tiling, {data['default_tiling']} (keys per tile x programs per "
         f"SM aimed at by split-KV): {median_by_budget(data['summary'])}. In the same run, "
         "at the tiling it had before: " + "; ".join(
             f"{name}: {median_by_budget(s)}" for name, s in data["summary"]["variants"].items())
         + f". Largest difference from the torch twin: {worst:.2g}. {data['device']}, "
         f"{data['dtype']}, {data['heads']} heads, latent {data['rank']} + {data['rope']}, "
         f"{data['page_size']}-token pages, {data['timing']}. Source: "
         f"{doc.link(MLA_ATTENTION)}; the tilings tried first, one run beside the tiling "
         f"{tilings['default_tiling']}: " + "; ".join(
             f"{name}: {median_by_budget(s)}"
             for name, s in tilings["summary"]["variants"].items())
         + f" ({doc.link(MLA_TILINGS)})."),
    ])


def median_by_budget(summary: dict) -> str:
    """A bench_mla_attention.py summary: the median ratio over every size, and by budget."""
    return (f"median tree ÷ decode {x(summary['median_ratio'])} over every size (by budget: "
            + ", ".join(f"B={b} {x(v)}" for b, v in summary["median_ratio_by_budget"].items())
            + ")")


@renderer("tree-attention")
def tree_attention(doc: Doc) -> str:
    """Tree attention over FlashAttention 3's causal attention, every measured size."""
    data = load(TREE_ATTENTION)
    grid = size_grid(data["results"], [
        ("FA3 ms", lambda r: f"{r['fa3_ms']:.4f}"),
        ("split ÷ FA3", lambda r: f"{r['split_ms'] / r['fa3_ms']:.2f}"),
        ("tree ÷ FA3", lambda r: f"{r['tree_ms'] / r['fa3_ms']:.2f}")])
    best = [min(r["tree_ms"], r["split_ms"]) / r["fa3_ms"] for r in data["results"]]
    within = sum(b <= 1.2 for b in best)
    return "\n".join([
        grid,
        "",
        (f"The faster of split and tree is within 1.2x of FlashAttention 3 at {within} of "
         f"{len(best)} sizes (largest {x(max(best))}; median {x(statistics.median(best))}). "
         f"{data['device']}, {data['dtype']}, heads {data['heads'][0]}/{data['heads'][1]} of "
         f"{data['head_dim']}, {data['page_size']}-token pages, {data['tree_layout']} trees, "
         f"{data['timing']}. Source: {doc.link(TREE_ATTENTION)}."),
    ])


@renderer("tree-ops")
def tree_ops(doc: Doc) -> str:
    """The plugin's tree build, walk and compaction next to a Qwen3-8B-shaped step."""
    name, run_name = TREE_OPS
    run = load(name)["runs"][run_name]
    rows = [[str(r["batch"]), str(r["budget"]), f"{r['build_graph_ms']:.3f}",
             f"{r['walk_graph_ms']:.3f}", f"{r['compact_graph_ms']:.3f}",
             f"{r['ops_graph_ms']:.3f}", f"{r['verify_step_ms']:.3f}", f"{r['graph_pct']:.1f}%"]
            for r in run["results"]]
    return "\n".join([
        table(["batch", "budget", "build ms", "walk ms", "compaction ms", "total ms",
               "verify step ms", "share"], rows),
        "",
        (f"One CUDA-graph replay each; vocabulary {run['vocab']}, depth {run['max_depth']}, "
         f"{run['layers']} layers, {run['context']}-token prefix, {run['device']}. "
         f"Source: {doc.link(name)} (run `{run_name}`)."),
    ])


@renderer("profile")
def profile(doc: Doc) -> str:
    """Per decode step of the real pair: time without profilers, host parts, GPU busy."""
    data = load(PROFILE)
    parts = ("LLMEngine.step", "GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens")
    rows = []
    for r in data["results"]:
        host = {p["part"]: p["host_ms"] for p in r["host_parts"]}
        name = r["method"] + (f" B={r['budget']}" if r.get("budget") else "")
        rows.append([name, str(r["batch"]), f"{r['unprofiled_ms_per_step']:.2f}",
                     f"{r['tokens_per_step']:.2f}", *(f"{host[p]:.2f}" for p in parts),
                     f"{r['kernel_ms_per_step']:.2f}", f"{r['gpu_busy_share']:.0%}"])
    return "\n".join([
        table(["method", "batch", "ms per step, no profiler", "tokens per step",
               "engine step, host ms", "execute_model", "sample_tokens", "kernel ms",
               "GPU busy"], rows),
        "",
        (f"Real pair on an H200, {data['runner'].upper()} runner, an earlier version of the "
         f"step than the end-to-end tables. Host times are inclusive, with timers in. "
         f"Source: {doc.link(PROFILE)}."),
    ])


# --- the blocks ------------------------------------------------------------------------


def render_text(text: str, doc: Doc) -> tuple[str, list[str]]:
    """``text`` with every block rendered, and the names whose blocks changed."""
    unknown = [n for n in OPENING.findall(text) if n not in RENDERERS]
    if unknown:
        raise KeyError(f"no renderer for block(s) {unknown}; known: {sorted(RENDERERS)}")
    changed: list[str] = []

    def fill(match: re.Match) -> str:
        # Blank lines around the table: markdown ends the marker's HTML block there.
        body = "\n" + RENDERERS[match[2]](doc).strip("\n") + "\n\n"
        if body != match[3]:
            changed.append(match[2])
        return match[1] + body + match[4]

    rendered = BLOCK.sub(fill, text)
    if len(BLOCK.findall(text)) != len(OPENING.findall(text)):
        raise ValueError("a <!-- results:NAME --> marker is indented or has no closing marker")
    return rendered, changed


def stale_blocks(docs: tuple[Path, ...] | None = None) -> list[str]:
    """``path: NAME`` for every block whose text is not what its renderer gives."""
    stale = []
    for path in DOCS if docs is None else docs:
        _, changed = render_text(path.read_text(), Doc(path))
        stale += [f"{path.relative_to(ROOT)}: {name}" for name in changed]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a block is stale; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_blocks()
        for entry in stale:
            print(f"stale: {entry}")
        if stale:
            print("run: python benchmarks/render_docs.py")
        return 1 if stale else 0
    for path in DOCS:
        text = path.read_text()
        rendered, changed = render_text(text, Doc(path))
        if changed:
            path.write_text(rendered)
            print(f"{path.relative_to(ROOT)}: rendered {', '.join(changed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
