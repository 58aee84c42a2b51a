"""End-to-end benchmark: non-speculative vs DFlash chain vs DDTree, one run.

For each method the same prompts (code, math, chat, prose) are generated at
T=0 and T=1, batch 1 and batch 8. Reported per row: tau (mean tokens committed
per verify step, bonus included), acceptance per depth, tokens/s and the
ratios to non-speculative decoding and to the chain, measured side by side.

    python benchmarks/bench_e2e.py --target DIR --drafter DIR      # full matrix
    python benchmarks/bench_e2e.py --quick                         # CI-sized run
    python benchmarks/bench_e2e.py --render results/e2e_h200.json  # table + plot again
    python benchmarks/bench_e2e.py --pool results/e2e_h200_a.json results/e2e_h200_b.json

Without --target/--drafter it uses the SmolLM2 pair when the trained drafter
is in models/, else tiny models it builds. Writes JSON (and a PNG plot when
matplotlib is installed) to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
TRAINED_DRAFTER = Path(__file__).resolve().parent.parent / "models" / "dflash-smollm2-135m-b8"

PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number.",
    "math": "What is 17 times 23? Explain the steps.",
    "chat": "Hi! Can you suggest three names for a small grey cat?",
    "prose": "Write a short paragraph about autumn in the mountains.",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=None,
                   help="an HF target directory (with --drafter)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="a DFlash drafter; alone: one for the real target (SmolLM2-135M)")
    p.add_argument("--pair", choices=("auto", "real", "tiny"), default="auto",
                   help="without --target/--drafter: the SmolLM2 pair (real), tiny random "
                        "models built here (tiny), or real when its drafter is in models/")
    p.add_argument("--methods", default="plain,chain,ddtree",
                   help="comma list of plain, chain, ddtree")
    p.add_argument("--baseline-runners", default="default",
                   help="comma list of default, v1, v1-async: plain and chain on vLLM's "
                        "default model runner and scheduling (rows plain, chain), on the V1 "
                        "runner without async scheduling (rows plain-v1, chain-v1) and/or "
                        "on the V1 runner with it (rows plain-v1-async, chain-v1-async); "
                        "the V1 rows are GPU only")
    p.add_argument("--ddtree-scheduling", default="default",
                   help="comma list of default, sync, async, v1, v2: DDTree rows with the "
                        "plugin's default runner (V2 on vLLM 0.33 with CUDA, else V1) and "
                        "scheduling (ddtree-b16-k4), on that runner without async "
                        "scheduling (ddtree-b16-k4-sync), with it (ddtree-b16-k4-async; GPU "
                        "only), on the V1 runner without it (ddtree-b16-k4-v1) and/or on "
                        "vLLM's V2 runner with vLLM's default scheduling "
                        "(ddtree-b16-k4-v2; vLLM 0.33 on GPU only)")
    p.add_argument("--quick", action="store_true",
                   help="a few configs, for CI (batch 1: the first prompt only)")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--caps", type=str, nargs="+", default=["1", "2", "4", "none"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device-name", default="cpu", help="label for the results file")
    p.add_argument("--graphs", action="store_true",
                   help="torch.compile + CUDA graphs (GPU); default enforce_eager, as the "
                        "CPU backend needs")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's memory share per engine (on the CPU backend it sizes CPU "
                        "memory); default 0.3, with --interleave at most 0.85 over the "
                        "engines")
    p.add_argument("--interleave", action="store_true",
                   help="start every method's engine first, then time their passes in "
                        "turn (each round: every row, every engine), so that a drift of "
                        "the machine's speed falls on all methods alike")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM's tensor parallelism (GPUs per engine)")
    p.add_argument("--no-custom-all-reduce", action="store_true",
                   help="NCCL's all-reduce instead of vLLM's custom one (TP > 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed generations per row; tokens/s from the median time")
    p.add_argument("--jit-monitor-verbose", action="store_true",
                   help="vLLM logs every Triton JIT compile during inference")
    p.add_argument("--out", type=Path, default=None, metavar="STEM",
                   help="write STEM.json and STEM.png (a .json or .png ending is "
                        "dropped); default benchmarks/results/e2e_<device-name>")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="print the table of an earlier run's JSON and write its plot "
                        "beside it; runs nothing")
    p.add_argument("--pool", type=Path, nargs="+", default=None, metavar="JSON",
                   help="pool the round-by-round ratios to the chain of earlier "
                        "--interleave runs' JSON files: table, and JSON to --out "
                        "(default benchmarks/results/e2e_pooled.json); runs nothing")
    p.add_argument("--pool-target", type=float, default=1.3,
                   help="with --pool, the ratio whose share of rounds is reported")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be at least 1")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"--gpu-memory-utilization must be in (0, 1]; got {args.gpu_memory_utilization}")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - {"plain", "chain", "ddtree"})
    if unknown or not args.methods:
        p.error(f"--methods takes plain, chain, ddtree; got {args.methods}")
    args.baseline_runners = [r.strip() for r in args.baseline_runners.split(",") if r.strip()]
    if not args.baseline_runners or set(args.baseline_runners) - set(BASELINE_SUFFIX):
        p.error(f"--baseline-runners takes default, v1, v1-async; got {args.baseline_runners}")
    args.ddtree_scheduling = [x.strip() for x in args.ddtree_scheduling.split(",") if x.strip()]
    if not args.ddtree_scheduling or set(args.ddtree_scheduling) - set(DDTREE_SUFFIX):
        p.error("--ddtree-scheduling takes default, sync, async, v1, v2; got "
                f"{args.ddtree_scheduling}")
    return args


# Row-name suffix of each engine setting, and what it sets: (the model runner forced,
# "v1" or "v2", async scheduling; None leaves vLLM's / the plugin's default).
BASELINE_SUFFIX = {"default": "", "v1": "-v1", "v1-async": "-v1-async"}
DDTREE_SUFFIX = {"default": "", "sync": "-sync", "async": "-async", "v1": "-v1", "v2": "-v2"}
_SETTINGS = {"-v1-async": ("v1", True), "-v1": ("v1", False), "-sync": (None, False),
             "-async": (None, True), "-v2": ("v2", None)}


def engine_overrides(name: str) -> tuple[str | None, bool | None]:
    """(the model runner forced or None, async scheduling or None) of a row, from its
    name."""
    for suffix, settings in _SETTINGS.items():  # "-v1-async" before "-async"
        if name.endswith(suffix):
            return settings
    return None, None


def check_model_args(args: argparse.Namespace) -> None:
    """--target needs its --drafter; --drafter alone is a drafter for the real target
    (SmolLM2-135M), so it cannot go with --pair tiny."""
    if args.target and not args.drafter:
        raise SystemExit("--target needs --drafter: a DFlash drafter trained for that target")
    if args.drafter and not args.target and args.pair == "tiny":
        raise SystemExit("--drafter without --target is a drafter for the real target "
                         "(SmolLM2-135M); --pair tiny builds its own drafter")


def real_target_drafter(args: argparse.Namespace) -> Path | None:
    """The drafter to pair with the real target (SmolLM2-135M) when no --target is
    given: --drafter, or the shipped one for --pair real (and auto, when it is there);
    None for the tiny pair."""
    if args.drafter or args.pair == "real" or (args.pair == "auto"
                                               and (TRAINED_DRAFTER / "config.json").exists()):
        return args.drafter or TRAINED_DRAFTER
    return None


def resolve_models(args: argparse.Namespace) -> tuple[Path, Path]:
    check_model_args(args)
    if args.target and args.drafter:
        return args.target, args.drafter
    drafter = real_target_drafter(args)
    if drafter is not None:
        from vllm_ddtree.checkpoints.smollm2 import make_smollm2

        return make_smollm2(), drafter
    from vllm_ddtree.checkpoints import tiny as tiny_models

    root = Path(os.environ.get("VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree"))
    target = root / "bench-tiny-target"
    if not (target / "config.json").exists():
        tiny_models.make_target(target, "llama", embed_std=3.0)
    drafter = root / "bench-tiny-drafter-b8"
    if not (drafter / "config.json").exists():
        tiny_models.make_dflash_drafter(drafter, target, block_size=8, mode="repeat")
    return target, drafter


def methods(args: argparse.Namespace, drafter: Path) -> list[tuple[str, dict | None]]:
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    out: list[tuple[str, dict | None]] = []
    suffixes = [BASELINE_SUFFIX[r] for r in args.baseline_runners]
    if "plain" in args.methods:
        out += [(f"plain{x}", None) for x in suffixes]
    if "chain" in args.methods:
        out += [(f"chain{x}", {"method": "dflash", "model": str(drafter),
                               "num_speculative_tokens": block - 1}) for x in suffixes]
    budgets, caps = (args.budgets, args.caps) if not args.quick else ([8], ["4"])
    for budget in budgets if "ddtree" in args.methods else []:
        for cap in caps:
            out += [(f"ddtree-b{budget}-k{cap}{DDTREE_SUFFIX[x]}", {
                "method": "ddtree", "model": str(drafter), "ddtree_budget": budget,
                "ddtree_topk_cap": None if cap == "none" else int(cap)})
                for x in args.ddtree_scheduling]
    return out


def spec_counters(llm) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            key = m.name.removeprefix("vllm:spec_decode_")
            stats[key] = getattr(m, "values", None) or getattr(m, "value", 0) or 0
    return stats


def start_engine(target: Path, config: dict | None, args: argparse.Namespace,
                 runner: str | None = None, async_scheduling: bool | None = None,
                 memory_share: float | None = None):
    """One vllm.LLM. ``runner``: "v1" or "v2" forced (None: vLLM's default, or
    DDTree's); ``async_scheduling``: on or off (None: the default); ``memory_share``:
    its gpu_memory_utilization (None: --gpu-memory-utilization, else 0.3)."""
    from vllm import LLM

    # The engine process reads the runner choice when it starts; a DDTree engine
    # started earlier in this process set it, so rows without a forced runner clear it.
    if runner is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    else:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    return LLM(model=str(target), speculative_config=config, dtype=args.dtype,
               enforce_eager=not args.graphs,
               gpu_memory_utilization=memory_share or args.gpu_memory_utilization or 0.3,
               max_model_len=1024, disable_log_stats=False, seed=0,
               tensor_parallel_size=args.tensor_parallel_size,
               disable_custom_all_reduce=args.no_custom_all_reduce,
               **({} if async_scheduling is None else {"async_scheduling": async_scheduling}),
               **({"jit_monitor_verbose": True} if args.jit_monitor_verbose else {}))


def timed_calls(llm, args: argparse.Namespace) -> dict[tuple[float, int], tuple[list, Any]]:
    """Per row (temperature, batch): the generate calls of one timed pass and their
    sampling parameters."""
    from vllm import SamplingParams

    prompts = [llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        for text in PROMPTS.values()]
    # Batch 1 runs each prompt alone, one after another, so its tau and tok/s cover
    # every kind of prompt (code, math, chat, prose) as batch 8 does (--quick: the
    # first alone, to stay inside CI's time).
    calls_at = {1: [[p] for p in prompts[: 1 if args.quick else None]], 8: [(prompts * 2)[:8]]}
    return {(temperature, batch): (calls_at[batch], SamplingParams(
        temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0))
        for temperature in (0.0, 1.0) for batch in (1, 8)}


def run_pass(llm, calls: list, params) -> int:
    """One pass of a row's calls; the tokens it generated."""
    outputs = [o for call in calls for o in llm.generate(call, params, use_tqdm=False)]
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def run_method(target: Path, config: dict | None, args: argparse.Namespace,
               runner: str | None = None, async_scheduling: bool | None = None
               ) -> tuple[list[dict], dict]:
    """Rows of one engine, timed while it is the only one, and the runner settings it
    resolved (``runner``, ``async_scheduling``: as start_engine)."""
    llm = start_engine(target, config, args, runner, async_scheduling)
    rows = []
    for (temperature, batch), (calls, params) in timed_calls(llm, args).items():
        # Warm-up: the timed calls once, so kernels meet every prompt's shapes (and
        # compile any variant they lack) before the clock starts. A warm-up of the
        # first prompt alone left batch 1's first timed round compiling for the
        # others (DDTree's repeats at aa28b91 spread x1.75, slowest first).
        run_pass(llm, calls, params)
        before = spec_counters(llm)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = run_pass(llm, calls, params)
            times.append(time.perf_counter() - start)
        row = summarize(before, spec_counters(llm), tokens, statistics.median(times),
                        temperature, batch)
        row["steps"] /= args.repeats  # the counters span every timed call
        row["seconds_each"] = [round(t, 6) for t in times]
        rows.append(row)
    settings = engine_settings(llm)
    llm.llm_engine.engine_core.shutdown()
    return rows, settings


def run_one_by_one(target: Path, named: list[tuple[str, dict | None]],
                   args: argparse.Namespace, write) -> tuple[dict, dict]:
    """Each method's engine started, timed and shut down before the next;
    ``write(results, engines)`` after every method, so a run cut short keeps what it
    measured."""
    results: dict[str, list[dict]] = {}
    engines: dict[str, dict] = {}
    for name, config in named:
        print(f"[bench] {name} ...", flush=True)
        start = time.perf_counter()
        runner, async_scheduling = engine_overrides(name)
        results[name], engines[name] = run_method(target, config, args, runner=runner,
                                                   async_scheduling=async_scheduling)
        print(f"[bench] {name}: {engines[name]}", flush=True)
        print(f"[bench] {name} done in {time.perf_counter() - start:.0f} s", flush=True)
        write(results, engines)
    return results, engines


def run_interleaved(target: Path, named: list[tuple[str, dict | None]],
                    args: argparse.Namespace, write) -> tuple[dict, dict]:
    """Every method's engine alive at once and their timed passes taken in turn, so
    that a change of the machine's speed during the run falls on all of them alike
    (seen on the H200: the same engine's batch-1 time moving 1.34x between runs
    minutes apart). ``write(results, engines)`` keeps what each round measured.

    vLLM keeps one metrics registry per process and a new engine clears it, so each
    engine's tau comes from one counted pass after its warm-up, read before the next
    engine starts: the timed calls with the same seeds and the prefix cache as warm as
    theirs (the first pass meets the prompts cold, and at T=1 a chain's drafts were
    seen to differ there)."""
    share = args.gpu_memory_utilization or round(min(0.3, 0.85 / len(named)), 3)
    engines: dict[str, dict] = {}
    live = []
    for name, config in named:
        print(f"[bench] {name}: starting engine {len(live) + 1} of {len(named)}", flush=True)
        llm = start_engine(target, config, args, *engine_overrides(name), memory_share=share)
        calls = timed_calls(llm, args)
        counted = {}
        for key, (batch_calls, params) in calls.items():
            run_pass(llm, batch_calls, params)  # warm-up, as run_method's
            before = spec_counters(llm)
            tokens = run_pass(llm, batch_calls, params)
            counted[key] = (before, spec_counters(llm), tokens)
        engines[name] = engine_settings(llm)
        live.append((name, llm, calls, counted))
    times: dict[str, dict[tuple, list[float]]] = {name: {} for name, *_ in live}
    results: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        turn = live[repeat % len(live):] + live[: repeat % len(live)]  # who goes first rotates
        for key in live[0][2]:
            for name, llm, calls, _ in turn:
                start = time.perf_counter()
                run_pass(llm, *calls[key])
                times[name].setdefault(key, []).append(time.perf_counter() - start)
        results = {name: [interleaved_row(counted[key], times[name][key], key)
                          for key in calls] for name, _, calls, counted in live}
        write(results, engines)
        print(f"[bench] timed round {repeat + 1} of {args.repeats}", flush=True)
    for _, llm, *_ in live:
        llm.llm_engine.engine_core.shutdown()
    return results, engines


def check_memory_shares(args: argparse.Namespace, num_engines: int) -> None:
    """With every engine alive at once, their memory shares must fit together."""
    share = args.gpu_memory_utilization
    if share is not None and share * num_engines > 0.95:
        raise SystemExit(
            f"--interleave keeps {num_engines} engines alive at once: "
            f"--gpu-memory-utilization {share} each would ask for {share * num_engines:.2f} "
            f"of the device; give at most {0.95 / num_engines:.3f} (or leave it out)")


def interleaved_row(counted: tuple, times: list[float], key: tuple[float, int]) -> dict:
    """A row from the counted pass's counters and the timed passes' times."""
    before, after, tokens = counted
    row = summarize(before, after, tokens, statistics.median(times), *key)
    row["seconds_each"] = [round(t, 6) for t in times]
    return row


def engine_settings(llm) -> dict[str, Any]:
    """The model runner and scheduling an engine resolved (None where unknown)."""
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    v2 = getattr(cfg, "use_v2_model_runner", None)
    return {"model_runner": None if v2 is None else ("v2" if v2 else "v1"),
            "async_scheduling": getattr(getattr(cfg, "scheduler_config", None),
                                        "async_scheduling", None)}


def summarize(before, after, tokens, elapsed, temperature, batch) -> dict:
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    per_pos_a = list(after.get("num_accepted_tokens_per_pos") or [])
    per_pos_b = list(before.get("num_accepted_tokens_per_pos") or [0] * len(per_pos_a))
    per_depth = [a - b for a, b in zip(per_pos_a, per_pos_b)]
    while per_depth and per_depth[-1] == 0:
        per_depth.pop()
    return {
        "temperature": temperature, "batch": batch, "tokens": tokens,
        "seconds": elapsed, "tok_per_s": tokens / elapsed,
        "steps": drafts, "tau": 1 + accepted / drafts if drafts else 1.0,
        "accept_rate_per_depth": [round(c / drafts, 4) for c in per_depth] if drafts else [],
    }


def print_table(results: dict[str, list[dict]]) -> None:
    """tok/s ratios to plain and to the chain (their default-runner rows, else the V1
    ones), and to the V1 chain as well when both chain rows ran."""
    def by_key(name: str) -> dict:
        return {(r["temperature"], r["batch"]): r for r in results.get(name, [])}

    base = by_key("plain" if "plain" in results else "plain-v1")
    chain = by_key("chain" if "chain" in results else "chain-v1")
    chain_v1 = by_key("chain-v1") if "chain" in results and "chain-v1" in results else {}
    print(f"{'method':<18}{'T':>4}{'batch':>6}{'tau':>7}{'tok/s':>9}"
          f"{'x plain':>9}{'x chain':>9}" + (f"{'x ch-v1':>9}" if chain_v1 else "")
          + "  per-depth acceptance")
    for name, rows in results.items():
        for r in rows:
            key = (r["temperature"], r["batch"])
            ratios = [r["tok_per_s"] / ref[key]["tok_per_s"] if key in ref else float("nan")
                      for ref in ([base, chain] + ([chain_v1] if chain_v1 else []))]
            depths = " ".join(f"{x:.2f}" for x in r["accept_rate_per_depth"][:8])
            each = r.get("seconds_each") or []
            # Slowest over fastest timed repeat: far above 1 means the repeats disagree.
            spread = f"  (repeats x{max(each) / min(each):.2f})" if len(each) > 1 else ""
            print(f"{name:<18}{r['temperature']:>4.1f}{r['batch']:>6}{r['tau']:>7.2f}"
                  f"{r['tok_per_s']:>9.1f}" + "".join(f"{x:>9.2f}" for x in ratios)
                  + f"  {depths}{spread}")


def greedy_batch1(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["temperature"] == 0.0 and r["batch"] == 1), None)


def plot(results: dict[str, list[dict]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for cap in sorted({n.split("-k")[1] for n in results if n.startswith("ddtree")}):
        names = sorted((n for n in results if n.endswith(f"-k{cap}")),
                       key=lambda n: int(n.split("-b")[1].split("-")[0]))
        points = [(int(n.split("-b")[1].split("-")[0]), greedy_batch1(results[n]))
                  for n in names]
        points = [(budget, r) for budget, r in points if r is not None]
        for ax, field in zip(axes, ("tau", "tok_per_s")):
            ax.plot([b for b, _ in points], [r[field] for _, r in points], marker="o",
                    label=f"DDTree top-k cap {cap}")
    for ax, field in zip(axes, ("tau", "tok_per_s")):
        for ref, color in (("chain", "grey"), ("plain", "black")):
            r = greedy_batch1(results.get(ref, []))
            if r is not None:
                ax.axhline(r[field], linestyle="--", color=color, label=ref)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget")
        ax.set_ylabel(field)
        ax.legend(fontsize=7)
    fig.suptitle("T=0, batch 1")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def render(path: Path) -> dict:
    """Table and plot of a results file (a run cut short keeps the methods it finished)."""
    results = json.loads(path.read_text())["results"]
    print_table(results)
    png = path.with_suffix(".png")
    print(f"[bench] wrote {png}" if plot(results, png)
          else "[bench] install matplotlib for the plot")
    return results


def round_ratios(results: dict[str, list[dict]]) -> dict[tuple[str, float, int], list[float]]:
    """Per (method, T, batch): each timed round's tokens/s over the chain's in the same
    round. Only an interleaved run pairs rounds so (its engines take turns inside each
    round); rows without a chain row, or with a round count unlike the chain's, are left
    out."""
    chain = {(r["temperature"], r["batch"]): r for r in
             results.get("chain", results.get("chain-v1", []))}
    ratios = {}
    for name, rows in results.items():
        if name.startswith(("chain", "plain")):
            continue
        for r in rows:
            ref = chain.get((r["temperature"], r["batch"]))
            each, ref_each = r.get("seconds_each") or [], (ref or {}).get("seconds_each") or []
            if not each or len(each) != len(ref_each):
                continue
            ratios[(name, r["temperature"], r["batch"])] = [
                (r["tokens"] / t) / (ref["tokens"] / t_ref) for t, t_ref in zip(each, ref_each)]
    return ratios


def bootstrap_median(runs: list[list[float]], draws: int = 2000, seed: int = 0,
                     level: float = 0.9) -> tuple[float, float]:
    """An interval for the median ratio: runs drawn with replacement, then rounds
    within each drawn run (a run's machine and minutes move all its rounds together,
    so rounds are not independent draws). Seeded: the same files give the same
    interval."""
    rng = random.Random(seed)
    medians = []
    for _ in range(draws):
        sample = []
        for run in rng.choices(runs, k=len(runs)):
            sample += rng.choices(run, k=len(run))
        medians.append(statistics.median(sample))
    medians.sort()
    tail = (1 - level) / 2
    return (medians[int(math.floor(tail * (draws - 1)))],
            medians[int(math.ceil((1 - tail) * (draws - 1)))])


def pool(paths: list[Path], out: Path, target: float = 1.3) -> dict:
    """The ratio to the chain over several interleaved runs, round by round: per row the
    rounds, each run's median, the pooled median with a 90% interval, the range and the
    share of rounds at or above ``target``. Prints a table and writes JSON to ``out``."""
    per_row: dict[tuple[str, float, int], list[tuple[str, list[float]]]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        if not data.get("interleaved"):
            raise SystemExit(f"{path} is not an --interleave run: its rounds are not paired "
                             "with the chain's, so there is nothing to pool")
        for key, ratios in round_ratios(data["results"]).items():
            per_row.setdefault(key, []).append((path.name, ratios))
    if not per_row:
        raise SystemExit("no row with the chain's rounds beside it in " +
                         ", ".join(str(p) for p in paths))
    rows = []
    for (name, temperature, batch), runs in sorted(per_row.items()):
        every = [x for _, ratios in runs for x in ratios]
        low, high = bootstrap_median([ratios for _, ratios in runs])
        rows.append({
            "method": name, "temperature": temperature, "batch": batch,
            "runs": [{"file": f, "rounds": len(r), "median": statistics.median(r)}
                     for f, r in runs],
            "rounds": len(every), "median": statistics.median(every),
            "interval_90": [low, high], "min": min(every), "max": max(every),
            "share_at_target": sum(x >= target for x in every) / len(every),
        })
    print(f"{'method':<18}{'T':>4}{'batch':>6}{'runs':>5}{'rounds':>7}{'median':>8}"
          f"{'90% interval':>15}{'range':>13}{f'>= {target:g}':>8}  run medians")
    for r in rows:
        print(f"{r['method']:<18}{r['temperature']:>4.1f}{r['batch']:>6}{len(r['runs']):>5}"
              f"{r['rounds']:>7}{r['median']:>8.2f}"
              f"{'%.2f-%.2f' % tuple(r['interval_90']):>15}"
              f"{'%.2f-%.2f' % (r['min'], r['max']):>13}{r['share_at_target']:>8.0%}  "
              + " ".join(f"{run['median']:.2f}" for run in r["runs"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"files": [str(p) for p in paths], "target": target,
                               "rows": rows}, indent=1))
    print(f"[bench] wrote {out}")
    return {"rows": rows}


def results_stem(args: argparse.Namespace) -> Path:
    """--out without a .json/.png ending (it names both files), or the default."""
    if args.out is None:
        return RESULTS / f"e2e_{args.device_name}{'_quick' if args.quick else ''}"
    return args.out.with_suffix("") if args.out.suffix in (".json", ".png") else args.out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.render:
        return render(args.render)
    if args.pool:
        out = RESULTS / "e2e_pooled" if args.out is None else results_stem(args)
        return pool(args.pool, Path(f"{out}.json"), args.pool_target)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    target, drafter = resolve_models(args)
    print(f"[bench] target {target}\n[bench] drafter {drafter}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = results_stem(args)

    def write(results: dict, engines: dict) -> None:
        Path(f"{stem}.json").write_text(json.dumps(
            {"target": str(target), "drafter": str(drafter), "max_tokens": args.max_tokens,
             "dtype": args.dtype, "graphs": args.graphs, "repeats": args.repeats,
             "interleaved": args.interleave,
             "tensor_parallel_size": args.tensor_parallel_size,
             "custom_all_reduce": not args.no_custom_all_reduce,
             "engines": engines,
             "results": results}, indent=1))

    named = methods(args, drafter)
    if args.interleave:
        check_memory_shares(args, len(named))
    run = run_interleaved if args.interleave else run_one_by_one
    results, engines = run(target, named, args, write)
    print_table(results)
    if plot(results, Path(f"{stem}.png")):
        print(f"[bench] wrote {stem}.json and {stem}.png")
    else:
        print(f"[bench] wrote {stem}.json (install matplotlib for the plot)")
    return results


if __name__ == "__main__":
    main()
