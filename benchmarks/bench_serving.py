"""Serving benchmark: plain decoding, vLLM's DFlash chain and DDTree under load, on
benchmark prompts nobody here wrote (MT-Bench, HumanEval, long inputs: prompt_sets.py).

Two modes, each over every method in one run:
- offline: LLM.generate at batch sizes 1..64 (tokens/s, tau);
- serve: vLLM's OpenAI server at 1..64 concurrent streaming requests (output tokens/s,
  TTFT and TPOT p50/p99, tau from the server's /metrics).
Engines stay alive together and are timed in turn, round after round, so a drift of the
machine falls on every method alike; each round pairs every method with plain decoding
and the chains. Medians come with 90% intervals (bench_e2e.bootstrap_median).

    python benchmarks/bench_serving.py --dry-run                  # the plan, nothing run
    python benchmarks/bench_serving.py --pair tiny                # CPU smoke run, a few minutes
    python benchmarks/bench_serving.py --target DIR --drafter DIR --mode offline --sets mt-bench
    python benchmarks/bench_serving.py --summarize A.json B.json  # pooled table + PNG

Writes STEM.json (every timed pass, a summary) and STEM.png (tokens/s against load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_e2e
import prompt_sets
import serving_client
import serving_summary
from serving_client import Method

RESULTS = bench_e2e.RESULTS
# Defaults of the full run, and of the CPU smoke run that --pair tiny selects.
FULL = {"sets": "mt-bench,humaneval,long", "batches": "1,2,4,8,16,32,64",
        "concurrency": "1,2,4,8,16,32,64", "max_tokens": 128, "rounds": 3, "min_prompts": 8,
        "methods": "plain,chain,chain-schedule,ddtree16,ddtree16-adaptive"}
SMOKE = {"sets": "smoke", "batches": "1,2", "concurrency": "1,2", "max_tokens": 16,
         "rounds": 2, "min_prompts": 2, "methods": "plain,ddtree8",
         "kv_cache_memory_bytes": 1 << 28}
# The chain's draft length by batch size (vLLM's num_speculative_tokens_per_batch_size),
# capped at block_size - 1: shorter chains as the verify batch grows.
DEFAULT_SCHEDULE = "1-8:7,9-16:5,17-32:3,33-:2"
DDTREE_NAME = re.compile(r"ddtree(\d+)(?:-k(\d+))?(-adaptive)?(-eager-steps)?$")
# "-eager-steps": the runner's own launches between replays run eagerly in that engine
# (VLLM_DDTREE_STEP_GRAPHS=0), beside the same method with them as graphs: what the
# step graphs, and their captures while serving, cost or save.
EAGER_STEPS_ENV = {"VLLM_DDTREE_STEP_GRAPHS": "0"}


def run_modes(args: argparse.Namespace) -> tuple[str, ...]:
    return ("offline", "serve") if args.mode == "both" else (args.mode,)


def largest_load(args: argparse.Namespace) -> int:
    """The most requests any pass of this run keeps in flight: what every engine's
    ``max_num_seqs`` defaults to. vLLM's own default (up to 1024) would have a DDTree
    engine capture graphs for verify steps of hundreds of requests no pass sends: on an
    H100, 320 capture sizes and about 100 s more start-up than 73 sizes at 64."""
    return max(max(args.batches if mode == "offline" else args.concurrency)
               for mode in run_modes(args))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=None,
                   help="an HF target directory (with --drafter)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="a DFlash drafter; alone: one for the real target (SmolLM2-135M)")
    p.add_argument("--pair", choices=("auto", "real", "tiny"), default="auto",
                   help="without --target/--drafter: the SmolLM2 pair (real) or tiny random "
                        "models (tiny; also the smoke plan for every option left out: "
                        + ", ".join(f"{k} {v}" for k, v in SMOKE.items()) + ")")
    p.add_argument("--mode", choices=("offline", "serve", "both"), default="both")
    p.add_argument("--methods", help="comma list of plain, chain, chain-schedule, ddtree<B>, "
                   "ddtree<B>-k<cap>, ddtree<B>-adaptive; a DDTree name ending in "
                   "-eager-steps runs the runner's step launches without CUDA graphs "
                   "(default " + FULL["methods"] + ")")
    p.add_argument("--chain-schedule", default=DEFAULT_SCHEDULE,
                   help="chain-schedule's draft length by batch size, 'first-last:K,...' "
                        "(an open last range: 'first-:K')")
    p.add_argument("--sets", help="comma list of " + ", ".join(prompt_sets.SET_NAMES))
    p.add_argument("--batches", help="offline batch sizes")
    p.add_argument("--concurrency", help="serve: concurrent requests")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--max-tokens", type=int, help="new tokens per request (EOS ignored)")
    p.add_argument("--rounds", type=int, help="timed rounds")
    p.add_argument("--min-prompts", type=int,
                   help="prompts per pass at least (offline: max(batch, this), in calls of "
                        "batch; serve: max(per-slot x concurrency, this) requests)")
    p.add_argument("--per-slot", type=int, default=2,
                   help="serve: requests per concurrent slot in a pass (default 2); more "
                        "make each pass longer and steadier")
    p.add_argument("--engines", choices=("together", "one-at-a-time"), default=None,
                   help="all engines alive and timed in turn (default with CUDA), or each "
                        "started, timed and stopped before the next (default on a CPU)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile + CUDA graphs (GPU); --no-graphs: eager")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="per engine; default 0.3, together at most 0.85 over the engines")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt plus --max-tokens, rounded up")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="per engine; default the largest batch or concurrency run (a DDTree "
                        "engine captures CUDA graphs for every verify step up to it)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--no-custom-all-reduce", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds, per server")
    p.add_argument("--seed", type=int, default=0, help="shuffles each prompt set")
    p.add_argument("--device-name", default="cpu")
    p.add_argument("--out", type=Path, default=None, metavar="STEM",
                   help="STEM.json and STEM.png; default benchmarks/results/serving_<device>")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSON",
                   help="pool the rounds of earlier runs: table, STEM.json and STEM.png")
    args = p.parse_args(argv)
    defaults = SMOKE if args.pair == "tiny" and not args.target else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for option, kind in (("methods", str), ("sets", str), ("batches", int),
                         ("concurrency", int), ("temperatures", float)):
        try:
            setattr(args, option, split(getattr(args, option), kind))
        except ValueError:
            p.error(f"--{option}: a comma list of {kind.__name__} values, got "
                    f"{getattr(args, option)!r}")
        if not getattr(args, option):
            p.error(f"--{option}: give at least one")
    for name in args.methods:
        if name not in ("plain", "chain", "chain-schedule") and not DDTREE_NAME.match(name):
            p.error(f"--methods: unknown method {name!r}; use plain, chain, chain-schedule, "
                    "ddtree<B>, ddtree<B>-k<cap>, ddtree<B>-adaptive, any DDTree one with "
                    "-eager-steps (e.g. ddtree16, ddtree16-adaptive-eager-steps)")
    if unknown := set(args.sets) - set(prompt_sets.SET_NAMES):
        p.error(f"--sets: unknown {sorted(unknown)}; the sets are {prompt_sets.SET_NAMES}")
    if min(args.batches + args.concurrency + [args.rounds, args.max_tokens]) < 1:
        p.error("--batches, --concurrency, --rounds and --max-tokens must be at least 1")
    if args.per_slot < 2:
        p.error("--per-slot must be at least 2 (later waves arrive while earlier ones decode)")
    try:
        parse_schedule(args.chain_schedule, 64)
    except ValueError as exc:
        p.error(f"--chain-schedule: {exc}")
    args.max_num_seqs = args.max_num_seqs or largest_load(args)
    return args


def split(text: str, kind: type) -> list:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


# --- methods ---------------------------------------------------------------------------


def parse_schedule(text: str, max_k: int) -> list[list[int]]:
    """'1-8:7,9-:2' -> [[1, 8, 7], [9, 4096, 2]]: vLLM's (first, last, K) ranges, from
    batch 1 on without gaps, K capped at ``max_k``."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)-(\d*):(\d+)\s*", part)
        if not m:
            raise ValueError(f"{part!r} is not 'first-last:K' or 'first-:K'")
        first, last = int(m[1]), int(m[2] or 4096)
        expected = out[-1][1] + 1 if out else 1
        if first != expected or last < first:
            raise ValueError(f"{part!r}: ranges must run from batch 1 on without gaps "
                             f"(this one should start at {expected})")
        out.append([first, last, min(int(m[3]), max_k)])
    return out


def plugin_keys() -> set[str]:
    """The speculative-config keys this vllm_ddtree accepts (empty where it is absent)."""
    try:
        from vllm_ddtree.config import USER_KEYS
    except ImportError:
        return set()
    return set(USER_KEYS)


def resolve_methods(names: list[str], drafter: Path, block: int, schedule: str,
                    keys: set[str]) -> list[Method]:
    """Each method name's speculative_config. DDTree rows say fixed or adaptive
    explicitly where the plugin has the key; "-adaptive" without it is skipped."""
    out = []
    for name in names:
        chain = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}
        if name == "plain":
            out.append(Method(name, None))
        elif name == "chain":
            out.append(Method(name, chain))
        elif name == "chain-schedule":
            out.append(Method(name, {**chain, "num_speculative_tokens_per_batch_size":
                                     parse_schedule(schedule, block - 1)}))
        else:
            budget, cap, adaptive, eager_steps = DDTREE_NAME.match(name).groups()
            config = {"method": "ddtree", "model": str(drafter), "ddtree_budget": int(budget),
                      "ddtree_topk_cap": int(cap) if cap else None}
            if "ddtree_adaptive" in keys:
                config["ddtree_adaptive"] = bool(adaptive)
            skip = None if not adaptive or "ddtree_adaptive" in keys else (
                "this vllm_ddtree has no ddtree_adaptive key yet")
            out.append(Method(name, config, skip, dict(EAGER_STEPS_ENV) if eager_steps else {}))
    return out


# --- the drivers: one per mode ---------------------------------------------------------


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """``env`` set in this process for the block, then as it was."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class OfflineDriver:
    """vllm.LLM engines in this process; tau from one counted pass per key at start-up
    (a new engine clears vLLM's metrics registry, so counters of older engines vanish)."""

    mode = "offline"

    def __init__(self, target: Path, args: argparse.Namespace, prompts: dict, share: float):
        self.target, self.args, self.prompts, self.share = target, args, prompts, share

    def launch(self, methods: list[Method]) -> None:
        """Nothing: engines in this process start one at a time, in ``start``."""

    def start(self, method: Method):
        from vllm import LLM

        serving_client.restore_runner_env()
        a = self.args
        extra = {k: v for k, v in (("kv_cache_memory_bytes", a.kv_cache_memory_bytes),
                                   ("max_num_seqs", a.max_num_seqs)) if v is not None}
        with environment(method.env):  # the engine's processes read it as they start
            return LLM(model=str(self.target), speculative_config=method.config,
                       dtype=a.dtype, enforce_eager=not a.graphs,
                       gpu_memory_utilization=self.share, max_model_len=a.max_model_len,
                       disable_log_stats=False, seed=0,
                       tensor_parallel_size=a.tensor_parallel_size,
                       disable_custom_all_reduce=a.no_custom_all_reduce, **extra)

    def run(self, llm, key: tuple, index: int) -> tuple[int, float]:
        """(tokens, seconds) of one pass: window ``index`` in calls of ``batch``."""
        from vllm import SamplingParams

        name, temperature, batch = key
        size = prompt_sets.pass_size("offline", batch, self.args.min_prompts)
        todo = prompt_sets.window(self.prompts[name], size, index)
        params = SamplingParams(temperature=temperature, max_tokens=self.args.max_tokens,
                                ignore_eos=True)
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(todo), batch):
            outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in todo[i:i + batch]],
                                params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens, time.perf_counter() - start

    def prepare(self, llm, method: Method, keys: list[tuple]) -> list[dict]:
        """Warm-up, then the counted pass (none for plain decoding), per key."""
        taus = []
        for key in keys:
            self.run(llm, key, 0)
            if method.config is None:
                continue
            before = bench_e2e.spec_counters(llm)
            tokens, seconds = self.run(llm, key, 0)
            s = bench_e2e.summarize(before, bench_e2e.spec_counters(llm), tokens, seconds,
                                    key[1], key[2])
            taus.append({"mode": self.mode, "method": method.name, "set": key[0],
                         "temperature": key[1], "load": key[2], "tau": s["tau"],
                         "steps": s["steps"],
                         "accept_rate_per_depth": s["accept_rate_per_depth"]})
        return taus

    def timed(self, llm, method: Method, key: tuple, round_index: int) -> dict:
        tokens, seconds = self.run(llm, key, round_index + 1)
        return {"mode": self.mode, "method": method.name, "set": key[0], "temperature": key[1],
                "load": key[2], "round": round_index, "tokens": tokens, "seconds": seconds,
                "tok_per_s": tokens / seconds}

    def settings(self, llm) -> dict:
        return bench_e2e.engine_settings(llm)

    def stop(self, llm) -> list[str]:
        llm.llm_engine.engine_core.shutdown()
        return []  # the engine logs to this process's own output

    def close(self) -> None:
        pass


# --- one phase: every method's engine, rounds in turn ---------------------------------------


def drive(driver, methods: list[Method], keys: list[tuple], rounds: int, together: bool,
          record) -> None:
    """Start, prepare and time every method's engine. Together: every engine is started
    (at once where the driver can: ``driver.launch``), then each warmed up in turn, and
    in each round each key is timed on every engine in turn, the first engine rotating
    from round to round; no engine warms up or is timed while another starts. Otherwise
    each engine runs all its rounds alone. ``record(kind, item)`` gets every result as
    it comes ("engine", "tau", "round"; "log": the plugin's log lines of a server)."""
    live: list[tuple[Method, Any]] = []

    def stop(method: Method, handle: Any) -> None:
        lines = driver.stop(handle)
        if lines:
            record("log", {"mode": driver.mode, "method": method.name, "lines": lines})

    def start(method: Method) -> bool:
        print(f"[serving] {driver.mode}: starting {method.name}", flush=True)
        started = time.perf_counter()
        try:
            handle = driver.start(method)
        except Exception as exc:  # noqa: BLE001 (one failed method must not end the run)
            record("engine", {"mode": driver.mode, "method": method.name,
                              "status": f"failed: {exc}"})
            print(f"[serving] {method.name} failed to start: {exc}", flush=True)
            return False
        live.append((method, handle))  # from here on the finally below stops it
        record("engine", {"mode": driver.mode, "method": method.name, "status": "ok",
                          "startup_s": round(time.perf_counter() - started, 1),
                          **driver.settings(handle)})
        return True

    def prepare(method: Method, handle: Any) -> None:
        for tau in driver.prepare(handle, method, keys):
            record("tau", tau)

    try:
        if not together:
            for method in methods:
                if not start(method):
                    continue
                prepare(*live[-1])
                for r in range(rounds):
                    for key in keys:
                        record("round", driver.timed(live[-1][1], method, key, r))
                stop(*live.pop())
            return
        driver.launch(methods)
        for method in methods:
            start(method)
        for method, handle in live:
            prepare(method, handle)
        for r in range(rounds):
            turn = live[r % len(live):] + live[:r % len(live)] if live else []
            for key in keys:
                for method, handle in turn:
                    record("round", driver.timed(handle, method, key, r))
            print(f"[serving] {driver.mode}: round {r + 1} of {rounds}", flush=True)
    finally:
        for method, handle in live:
            stop(method, handle)
        driver.close()


# --- plan, run, main ---------------------------------------------------------------------


def keys_for(mode: str, args: argparse.Namespace) -> list[tuple]:
    loads = args.batches if mode == "offline" else args.concurrency
    return [(s, t, load) for s in args.sets for t in args.temperatures for load in loads]


def plan_lines(args: argparse.Namespace, methods: list[Method], sizes: dict[str, list[int]],
               together: bool, share: float) -> list[str]:
    """What a run does: engines, methods and their configs, prompt sets, passes per round
    and the tokens each method generates."""
    runnable = [m for m in methods if not m.skip]
    engines = "together, timed in turn" if together else "one at a time"
    lines = [(f"engines: {engines}, {len(runnable)} per mode, gpu_memory_utilization "
              f"{share} each, max_num_seqs {args.max_num_seqs}; {args.rounds} timed rounds; "
              f"{args.max_tokens} new tokens per request")]
    for m in methods:
        lines.append(f"  {m.name:<20}" + (f"skipped: {m.skip}" if m.skip else
                                          json.dumps(m.config) if m.config else "no drafter")
                     + "".join(f" {k}={v}" for k, v in m.env.items()))
    for name, tokens in sizes.items():
        lines.append(f"set {name}: " + (
            f"{len(tokens)} prompts, {min(tokens)}-{max(tokens)} tokens "
            f"(median {statistics.median(tokens):.0f})" if tokens else "not available"))
    for mode in run_modes(args):
        per_round = sum(prompt_sets.pass_size(mode, k[2], args.min_prompts, args.per_slot)
                        for k in keys_for(mode, args) if sizes.get(k[0]))
        extra = 2 if mode == "offline" else 1  # offline: warm-up and counted pass
        what = "batch" if mode == "offline" else "concurrency"
        loads = args.batches if mode == "offline" else args.concurrency
        lines.append(f"{mode}: {what} {','.join(map(str, loads))}; per method "
                     f"{per_round} requests a round, {(args.rounds + extra) * per_round} with "
                     f"warm-up, about {(args.rounds + extra) * per_round * args.max_tokens:,} "
                     "tokens")
        if mode == "serve" and together:
            lines.append("serve: servers launched at once (KV cache sized ahead)"
                         if args.kv_cache_memory_bytes is not None else
                         "serve: servers start one after another (--kv-cache-memory-bytes "
                         "launches them at once)")
    return lines


def plan_models(args: argparse.Namespace) -> tuple[str, Path, int]:
    """(target label, drafter, block size) without building anything, for --dry-run."""
    bench_e2e.check_model_args(args)
    if args.target and args.drafter:
        target, drafter = str(args.target), args.drafter
    elif (drafter := bench_e2e.real_target_drafter(args)) is not None:
        target = "SmolLM2-135M-Instruct (converted on first use)"
    else:
        return "tiny random Llama (built on first use)", Path("<tiny drafter>"), 8
    return target, drafter, json.loads((drafter / "config.json").read_text())["block_size"]


def dry_run(args: argparse.Namespace) -> list[str]:
    target, drafter, block = plan_models(args)
    methods = resolve_methods(args.methods, drafter, block, args.chain_schedule, plugin_keys())
    sizes = {}
    for name in args.sets:
        try:
            sizes[name] = [prompt_sets.approx_tokens(list(p.messages))
                           for p in prompt_sets.load_set(name)]
        except FileNotFoundError as exc:
            print(f"[plan] {exc}")
            sizes[name] = []
    # Without --engines the run decides by CUDA; the plan shows the CUDA case.
    together = args.engines != "one-at-a-time"
    lines = [f"target {target}", f"drafter {drafter} (block {block})",
             "prompt tokens are estimated here (4 characters a token)"]
    lines += plan_lines(args, methods, sizes, together, memory_share(args, methods, together))
    if args.engines is None:
        lines.append("engines together where CUDA is available, else one at a time")
    for line in lines:
        print(f"[plan] {line}")
    return lines


def memory_share(args: argparse.Namespace, methods: list[Method], together: bool) -> float:
    if args.gpu_memory_utilization:
        return args.gpu_memory_utilization
    runnable = max(1, sum(not m.skip for m in methods))
    return round(min(0.3, 0.85 / runnable), 3) if together else 0.3


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def results_stem(args: argparse.Namespace, default: str) -> Path:
    if args.out is None:
        return RESULTS / default
    return args.out.with_suffix("") if args.out.suffix in (".json", ".png") else args.out


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    # This process touches CUDA before its engines start (memory share, prompt sets):
    # their engine-core processes must be spawned, not forked.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    target, drafter = bench_e2e.resolve_models(args)
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    methods = resolve_methods(args.methods, drafter, block, args.chain_schedule, plugin_keys())
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = prompt_sets.tokenized(args.sets, tokenizer, args.seed)
    longest = max(len(p.token_ids) for ps in prompts.values() for p in ps)
    args.max_model_len = args.max_model_len or 256 * math.ceil((longest + args.max_tokens + 8)
                                                               / 256)
    together = args.engines == "together" if args.engines else cuda_available()
    share = memory_share(args, methods, together)
    sizes = {n: [len(p.token_ids) for p in ps] for n, ps in prompts.items()}
    for line in [f"target {target}", f"drafter {drafter} (block {block})",
                 f"max_model_len {args.max_model_len}"] + plan_lines(args, methods, sizes,
                                                                     together, share):
        print(f"[serving] {line}", flush=True)
    stem = results_stem(args, f"serving_{args.device_name}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": "bench_serving", "target": str(target), "drafter": str(drafter),
            "device": args.device_name, "engines_together": together,
            "settings": {k: getattr(args, k) for k in (
                "mode", "max_tokens", "rounds", "min_prompts", "per_slot", "temperatures", "batches",
                "concurrency", "dtype", "graphs", "max_model_len", "max_num_seqs",
                "tensor_parallel_size", "chain_schedule", "seed")} | {"gpu_memory_utilization": share},
            "methods": {m.name: {"config": m.config, "skip": m.skip, "env": m.env}
                        for m in methods},
            "prompt_sets": {n: {"count": len(ps), "tokens_min": min(sizes[n]),
                                "tokens_median": statistics.median(sizes[n]),
                                "tokens_max": max(sizes[n]), "ids": [p.id for p in ps]}
                            for n, ps in prompts.items()},
            "engines": [], "tau": [], "rounds": [], "server_logs": []}

    def record(kind: str, item: dict) -> None:
        data[{"engine": "engines", "tau": "tau", "round": "rounds",
              "log": "server_logs"}[kind]].append(item)
        Path(f"{stem}.json").write_text(json.dumps(data, indent=1))

    runnable = [m for m in methods if not m.skip]
    for mode in run_modes(args):
        driver_cls = OfflineDriver if mode == "offline" else serving_client.ServerDriver
        drive(driver_cls(target, args, prompts, share), runnable, keys_for(mode, args),
              args.rounds, together, record)
    data["summary"] = serving_summary.report([data])
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1))
    print(f"[serving] wrote {stem}.json{serving_summary.draw(data['summary'], stem)}")
    return data


def main(argv: list[str] | None = None) -> Any:
    args = parse_args(argv)
    if args.summarize:
        return serving_summary.pool_files(args.summarize,
                                          results_stem(args, "serving_pooled"))
    if args.dry_run:
        return dry_run(args)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # `timeout` sends SIGTERM: made a SystemExit, it runs the drivers' finally blocks,
    # which stop every engine and server this run started.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
