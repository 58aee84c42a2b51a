"""Where a decode step's time goes, in vLLM on a GPU: torch.profiler over the steps of
one engine per configuration, same models and engine settings as bench_gpu_step.py.

Each configuration runs in its own process with the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the profiler sees the scheduler, the model
runner and the plugin's hooks together. For each it reports, per decode step:

- wall time, and the GPU's busy time (sum of kernel times) as a share of it;
- each DDTree phase (``ddtree.*`` ranges, vllm_ddtree/sync.py ``step_phase``): host
  time and the kernel time it launched;
- the operators with the most host time and the most kernel time;
- without any profiler, the host time of the step's parts (scheduler, model runner
  phases, the plugin's hooks), timed with ``perf_counter`` around each call:
  inclusive times, so nested parts also count in their callers.

    python benchmarks/profile_gpu_step.py --configs chain:1 ddtree16:1 ddtree16:32

``ddtree16@K:BATCH`` fixes the tree at K nodes on every step (vLLM's batch-size
schedule, as ``ddtree_adaptive`` drives it; K = 0: no drafts), so a step of each size
the sizer may choose can be profiled on its own, size 0 against plain decoding.

By default the engines run the Qwen3-8B shape with dummy weights and token-id prompts,
as bench_gpu_step.py does, without async scheduling. ``--target DIR --drafter DIR``
profiles a real pair instead (real weights; the chat prompts of bench_e2e.py, 128 new
tokens; vLLM's default scheduling), where drafts are accepted and the step does the
work acceptance brings. ``--runner`` picks the model runner (default v2, DDTree's on
vLLM 0.33 with CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import bench_gpu_step as step_bench
from gpu_step_timing import read_counters

DEFAULT_OUT = BENCH_DIR / "results" / "gpu_profile.json"


def parse_config(text: str) -> tuple[str, int | None, int, int | None]:
    """'plain:1', 'chain:8', 'ddtree16:32', 'ddtree16@0:8' -> (method, budget, batch,
    fixed tree size or None)."""
    name, _, batch = text.partition(":")
    if not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want METHOD:BATCH, e.g. ddtree16:1")
    if name in ("plain", "chain"):
        return name, None, int(batch), None
    name, at, size = name.partition("@")
    if (name.startswith("ddtree") and name[6:].isdigit() and int(name[6:]) >= 1
            and (not at or (size.isdigit() and int(size) <= int(name[6:])))):
        return "ddtree", int(name[6:]), int(batch), int(size) if at else None
    raise argparse.ArgumentTypeError(f"{text!r}: method is plain, chain, ddtreeB or "
                                     "ddtreeB@K (K <= B nodes on every step)")


def config_label(method: str, budget: int | None, batch: int, size: int | None) -> str:
    return f"{method}{budget or ''}{'' if size is None else f'@{size}'}:{batch}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", type=parse_config,
                   default=[parse_config(c) for c in ("plain:1", "chain:1", "ddtree16:1")])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=24, help="decode steps profiled")
    p.add_argument("--top", type=int, default=20, help="operators listed per table")
    p.add_argument("--model-dir", type=Path, default=step_bench.DEFAULT_MODEL_DIR)
    p.add_argument("--runner", choices=("v1", "v2"), default="v2",
                   help="model runner of every engine (VLLM_USE_V2_MODEL_RUNNER)")
    p.add_argument("--target", type=Path, default=None,
                   help="a real target checkpoint, profiled with --drafter's DFlash drafter")
    p.add_argument("--drafter", type=Path, default=None)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one config, print JSON
    args = p.parse_args(argv)
    if (args.target is None) != (args.drafter is None):
        p.error("--target and --drafter go together")
    return args


REAL_MAX_TOKENS = 128  # new tokens per request on a real pair, as bench_e2e's H200 runs
REAL_TOPK_CAP = 4      # bench_e2e's ddtree-b*-k4 rows


def real_engine(method: str, budget: int | None, batch: int, size: int | None,
                args: argparse.Namespace):
    """An engine on the real pair and ``batch`` of bench_e2e's chat prompts (in turn);
    ``size``: the tree's nodes on every step (None: the budget)."""
    import bench_e2e
    from vllm import LLM

    block = json.loads((args.drafter / "config.json").read_text())["block_size"]
    spec = {"plain": None,
            "chain": {"method": "dflash", "model": str(args.drafter),
                      "num_speculative_tokens": block - 1},
            "ddtree": {"method": "ddtree", "model": str(args.drafter),
                       "ddtree_budget": budget, "ddtree_topk_cap": REAL_TOPK_CAP}}[method]
    if size is not None:
        spec["num_speculative_tokens_per_batch_size"] = [[1, 1 << 20, size]]
    llm = LLM(model=str(args.target), speculative_config=spec, dtype="bfloat16",
              max_model_len=1024, gpu_memory_utilization=0.3, seed=0, disable_log_stats=False)
    texts = list(bench_e2e.PROMPTS.values())
    template = llm.get_tokenizer().apply_chat_template
    prompts = [template([{"role": "user", "content": texts[i % len(texts)]}], tokenize=False,
                        add_generation_prompt=True) for i in range(batch)]
    return llm, prompts


def engine_args(batch: int, budget: int | None, prompt_len: int, steps: int) -> argparse.Namespace:
    """bench_gpu_step's engine settings for one (batch, budget): graphs for this batch only."""
    width = (budget or step_bench.BLOCK_SIZE) + 1
    return argparse.Namespace(
        batches=[batch], budgets=[budget or 16], max_model_len=prompt_len + 4 * steps * width + 64,
        gpu_memory_utilization=0.85, max_num_seqs=max(batch, 8),
        max_num_batched_tokens=max(8192, batch * width), sync_scheduling=True,
        all_capture_sizes=False, shape=step_bench.QWEN3_8B)


def device_time(event: Any, self_only: bool = False) -> float:
    """Kernel microseconds of a profiler event (the attribute name moved across torch)."""
    for name in (("self_device_time_total", "self_cuda_time_total") if self_only
                 else ("device_time_total", "cuda_time_total")):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def is_device_work(event: Any) -> bool:
    """A kernel, copy or memset on the device: not a host operator (whose own device
    time repeats its kernels') and not a range's span on the GPU timeline (a
    ``record_function`` range, idle gaps included)."""
    kind = str(getattr(event, "device_type", "")).rsplit(".", 1)[-1]
    return kind not in ("CPU", "") and not getattr(event, "is_user_annotation", False)


def phase_times(averages: Any, raw_events: Any, steps: float) -> dict:
    """Per step, for each ``ddtree.*`` range: host time (the host-side range,
    children included) and the span of its launches on the GPU."""
    phases: dict[str, dict] = {}
    for e in averages:
        if not e.key.startswith("ddtree."):
            continue
        host_us = sum(r.cpu_time_total for r in raw_events
                      if r.name == e.key and not is_device_work(r)
                      and str(getattr(r, "device_type", "CPU")).endswith("CPU"))
        phases[e.key] = {"host_ms": host_us / 1e3 / steps,
                         "kernel_ms": device_time(e) / 1e3 / steps,
                         "calls_per_step": e.count / steps}
    return phases


def profile_one(method: str, budget: int | None, batch: int, size: int | None,
                args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    import torch
    from vllm import SamplingParams

    speculative = method != "plain"
    if args.target is not None:
        llm, prompts = real_engine(method, budget, batch, size, args)
        max_tokens = REAL_MAX_TOKENS
    else:
        if size is not None:
            raise SystemExit("ddtreeB@K profiles the real pair: give --target and --drafter")
        target, drafter = step_bench.write_models(args.model_dir)
        run = step_bench.EngineRun(args.runner, method, budget)
        llm = step_bench.make_engine(run, target, drafter,
                                     engine_args(batch, budget, args.prompt_len, args.steps))
        prompts = step_bench.make_prompts(batch, args.prompt_len)
        max_tokens = args.steps
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: shapes, prefix cache
    before = read_counters(llm)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    after = read_counters(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # Without any profiler: the step's own wall time, and then the Python functions
    # with the most host time under cProfile (what the torch profiler counts as a
    # range's self time: interpreter work that launches no operator).
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    plain_seconds = time.perf_counter() - start
    python_top = python_profile(lambda: llm.generate(prompts, params, use_tqdm=False),
                                args.top)
    with PhaseTimer() as timer:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    # Decode steps per request (+1: the prefill step, which this call also runs); a
    # step of size 0 drafts nothing and yields one token per request.
    drafts = after["drafts"] - before["drafts"]
    steps = drafts / batch if speculative and size != 0 else tokens / batch
    steps = max(1.0, steps)
    events = prof.key_averages()
    kernel_us = sum(device_time(e, self_only=True) for e in events if is_device_work(e))
    phases = phase_times(events, prof.events(), steps)
    rows = [{"op": e.key, "calls_per_step": e.count / steps,
             "self_host_ms": e.self_cpu_time_total / 1e3 / steps,
             "self_kernel_ms": device_time(e, self_only=True) / 1e3 / steps} for e in events]
    top = args.top
    return {
        "method": method, "budget": budget, "size": size, "batch": batch,
        "runner": args.runner, "pair": "real" if args.target is not None else "qwen3-8b-dummy", "steps": steps,
        "tokens_per_step": tokens / batch / steps,
        "wall_ms_per_step": 1e3 * seconds / steps,
        "unprofiled_ms_per_step": 1e3 * plain_seconds / steps,
        "python_top": python_top,
        "host_parts": timer.per_step(steps),
        "kernel_ms_per_step": kernel_us / 1e3 / steps,
        "gpu_busy_share": kernel_us / 1e6 / seconds,
        "phases": phases,
        "top_host": sorted(rows, key=lambda r: -r["self_host_ms"])[:top],
        "top_kernel": sorted(rows, key=lambda r: -r["self_kernel_ms"])[:top],
    }


# (module, class or None, attribute): the calls PhaseTimer times. Missing ones are
# skipped (a chain engine has no DDTree sampler; vLLM may rename a method).
TIMED = (
    ("vllm.v1.engine.llm_engine", "LLMEngine", "step"),
    ("vllm.v1.engine.core", "EngineCore", "step"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_calc_spec_decode_metadata"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_build_attention_metadata"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner",
     "_determine_batch_execution_and_padding"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_preprocess"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_bookkeeping_sync"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "propose"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer",
     "prepare_next_token_ids_padded"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "prepare_inputs_padded"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer",
     "build_per_group_and_layer_attn_metadata"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer",
     "build_model_inputs_first_pass"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer",
     "_determine_batch_execution_and_padding"),
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "_greedy_sample"),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer", "set_inputs_first_pass"),
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper", "__call__"),
    ("vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward"),
    ("vllm_ddtree.runner.v1_proposer", "DDTreeProposer", "propose"),
    ("vllm_ddtree.runner.v1_proposer", None, "build_ddtree"),
    ("vllm_ddtree.runner.v1_proposer", "DDTreeProposer", "_sample_draft_tokens"),
    ("vllm_ddtree.ops.tree", None, "topk_per_depth"),
    ("vllm_ddtree.runner.v1", None, "step_trees"),
    ("vllm_ddtree.runner.v1", None, "tree_positions"),
    ("vllm_ddtree.attention.state", "TreeAttentionInfo", "prepare_for"),
    ("vllm_ddtree.runner.v1_sampler", "DDTreeSampler", "forward"),
    ("vllm_ddtree.runner.v1_sampler", None, "process_logits"),
    ("vllm_ddtree.runner.v1_sampler", None, "walk_tree"),
    ("vllm_ddtree.runner.v1", None, "begin_verify_step"),
    ("vllm_ddtree.runner.v1", None, "compact_after_walk"),
    ("vllm_ddtree.runner.v1", None, "record_drafted_trees"),
    ("vllm_ddtree.attention.common", "TreeMetadataBuilderMixin", "build"),
    # The attention metadata build split up: vLLM's FlashAttention builder (both
    # methods' steps) and DDTree's layer over it (the prefix schedule of a tree step).
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder", "build"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder",
     "_get_scheduler_metadata"),
    ("vllm_ddtree.attention.cuda", "DDTreeFlashAttentionMetadataBuilder", "build"),
    ("vllm_ddtree.attention.cuda", "DDTreeFlashAttentionMetadataBuilder",
     "_get_scheduler_metadata"),
    # The V2 runner (vLLM 0.33) and DDTree's hooks in it.
    *(("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", name) for name in (
        "execute_model", "update_requests", "add_requests", "prepare_inputs",
        "prepare_attn", "sample", "postprocess_sampled", "sample_tokens",
        "postprocess_num_computed_tokens")),
    # V2's metadata build for every attention group, as its default model state calls it.
    ("vllm.v1.worker.gpu.model_states.default", None, "build_attn_metadata"),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler", "__call__"),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler", "sample"),
    ("vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler", "__call__"),
    *(("vllm.v1.worker.gpu.spec_decode.dflash.speculator", "DFlashSpeculator", name)
      for name in ("propose", "_generate_draft", "_run_model", "set_attn",
                   "_precompute_context_kv", "_store_hidden_states",
                   "prepare_context_anchor")),
    ("vllm_ddtree.runner.v2_speculator", "DDTreeSpeculator", "propose"),
    ("vllm_ddtree.runner.v2_speculator", "DDTreeSpeculator", "_generate_draft"),
    ("vllm_ddtree.runner.v2", None, "begin_verify_step"),
    ("vllm_ddtree.runner.v2", None, "publish_for_build"),
    ("vllm_ddtree.runner.v2", None, "tree_allowed"),
    ("vllm_ddtree.runner.v2", None, "step_trees_triton"),
    ("vllm_ddtree.runner.common", "StepAttentionInfos", "__call__"),
    ("vllm_ddtree.runner.v2_speculator", "DDTreeSpeculator", "map_batch"),
    ("vllm_ddtree.runner.v2_sampler", None, "walk_rows"),
    ("vllm_ddtree.runner.v2_sampler", None, "compact_accepted"),
    ("vllm_ddtree.runner.v2_sampler", "DDTreeV2Sampler", "__call__"),
    ("vllm_ddtree.runner.v2_sampler", "DDTreeV2Sampler", "_walk_and_compact"),
    ("vllm_ddtree.runner.step_graphs", "StepGraphs", "run"),
)


class PhaseTimer:
    """Host time of the TIMED calls while in the block: each is wrapped in a
    ``perf_counter`` pair (no profiler, no device sync), then restored."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._restore: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Self:
        import importlib

        for module_name, class_name, attr in TIMED:
            try:
                owner = importlib.import_module(module_name)
                if class_name is not None:
                    owner = getattr(owner, class_name)
                original = owner.__dict__[attr]
            except (ImportError, AttributeError, KeyError):
                continue
            label = f"{class_name + '.' if class_name else ''}{attr}"
            owner_attr = (owner, attr, original)
            setattr(owner, attr, self._timed(label, original))
            self._restore.append(owner_attr)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)
        self._restore.clear()

    def _timed(self, label: str, fn):
        import functools

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        return timed

    def per_step(self, steps: float) -> list[dict]:
        rows = [{"part": label, "host_ms": 1e3 * secs / steps,
                 "calls_per_step": self.calls[label] / steps}
                for label, secs in self.seconds.items()]
        return sorted(rows, key=lambda r: -r["host_ms"])


def python_profile(work, top: int) -> list[dict]:
    """The functions with the most own (tottime) host time while ``work`` runs."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(work)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = [{"function": f"{Path(file).name}:{line}:{name}", "calls": nc,
             "own_ms": 1e3 * tt, "total_ms": 1e3 * ct}
            for (file, line, name), (_, nc, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def run_isolated(config: tuple[str, int | None, int, int | None],
                 args: argparse.Namespace) -> dict:
    """One configuration in a fresh process (an in-process engine keeps its GPU memory)."""
    method, budget, batch, size = config
    label = config_label(*config)
    cmd = [sys.executable, __file__, "--one", label, "--prompt-len", str(args.prompt_len),
           "--steps", str(args.steps), "--top", str(args.top), "--model-dir", str(args.model_dir),
           "--runner", args.runner]
    if args.target is not None:
        cmd += ["--target", str(args.target), "--drafter", str(args.drafter)]
    print(f"[profile] {label}: starting", flush=True)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    marker = "PROFILE_JSON "
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    tail = (proc.stdout + proc.stderr)[-3000:]
    print(tail, flush=True)
    return {"method": method, "budget": budget, "size": size, "batch": batch,
            "error": f"exit code {proc.returncode}", "log_tail": tail}


def report(result: dict) -> str:
    size = result.get("size")
    name = (f"{result['method']}{result['budget'] or ''}"
            f"{'' if size is None else f' at {size} nodes'} batch {result['batch']}"
            f"{' on ' + result['runner'].upper() if result.get('runner') else ''}")
    if "error" in result:
        return f"== {name}: {result['error']}"
    lines = [(f"== {name}: {result['wall_ms_per_step']:.2f} ms/step wall, "
             f"{result['kernel_ms_per_step']:.2f} ms kernels "
             f"(GPU busy {100 * result['gpu_busy_share']:.0f}%), {result['steps']:.0f} steps"
             + (f", {result['tokens_per_step']:.2f} tokens/step"
                if "tokens_per_step" in result else ""))]
    if "unprofiled_ms_per_step" in result:
        lines.append(f"   without profilers: {result['unprofiled_ms_per_step']:.2f} ms/step")
    for key, p in sorted(result["phases"].items()):
        lines.append(f"   {key:24s} host {p['host_ms']:7.3f} ms  kernels {p['kernel_ms']:7.3f} ms"
                     f"  calls/step {p['calls_per_step']:5.1f}")
    for title, rows, col in (("host", result["top_host"], "self_host_ms"),
                             ("kernel", result["top_kernel"], "self_kernel_ms")):
        lines.append(f"   top {title} time per step:")
        lines += [f"     {r[col]:7.3f} ms  x{r['calls_per_step']:6.1f}  {r['op'][:90]}"
                  for r in rows]
    if result.get("host_parts"):
        lines.append("   host time of the step's parts per step (no profiler, inclusive):")
        lines += [f"     {r['host_ms']:7.3f} ms  x{r['calls_per_step']:6.1f}  {r['part']}"
                  for r in result["host_parts"]]
    if result.get("python_top"):
        steps = result["steps"]
        lines.append("   top Python functions per step (cProfile, own time):")
        lines += [f"     {r['own_ms'] / steps:7.3f} ms  x{r['calls'] / steps:6.1f}  "
                  f"{r['function'][:90]}" for r in result["python_top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        print("PROFILE_JSON " + json.dumps(profile_one(*parse_config(args.one), args)), flush=True)
        return
    results = []
    for config in args.configs:
        results.append(run_isolated(config, args))
        print(report(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompt_len": args.prompt_len, "steps": args.steps,
                                    "runner": args.runner,
                                    "target": None if args.target is None else str(args.target),
                                    "drafter": None if args.drafter is None else str(args.drafter),
                                    "results": results}, indent=1) + "\n")
    print(f"[profile] wrote {args.out}")


if __name__ == "__main__":
    main()
