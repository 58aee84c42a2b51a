"""Step cost in real vLLM on a GPU: plain decoding vs the DFlash chain vs DDTree.

One process, one engine per configuration (created, measured, shut down), CUDA graphs
and torch.compile as vLLM sets them by default, bf16, dummy weights:

- target: a Qwen3-8B-shaped model (36 layers, hidden 4096, 32/8 heads of 128,
  vocabulary 151936); drafter: a z-lab-layout DFlash drafter for it (5 layers, block 16).
  With `--shape kimi-k2.6`: Kimi K2.6's text model at full width (MLA, 384 routed
  experts, vocabulary 163840), its first (dense) layer and `--moe-layers` MoE layers
  (2: about 69 GiB in bf16, an H200), and a drafter in the shape of the public Kimi
  DFlash drafters (6 layers, 8 KV heads of 128, block 8, YaRN), fed by every target
  layer. Only config.json files are written (`load_format="dummy"`), so no hub is needed.
- runs: plain decoding and vLLM's native DFlash chain (15 drafts) on the V1 and the V2
  model runner, DDTree at each budget on V1 (the runner the plugin uses by default)
  and, with `--ddtree-runners v1,v2`, on V2 too; each engine
  at batch 1, 8 and 32 with prompts of token ids (no tokenizer).
- time per step: two generate calls with the same prompts at two output lengths; the
  wall-time difference over the step difference cancels prefill. Steps come from vLLM's
  spec-decode metrics (`num_drafts` counts one draft per request per verify step), or
  the generated tokens per request for plain decoding.
- plugin share: `bench_tree_ops.measure_ops` (tree build + walk + compaction, CUDA
  graph) at the same shapes, as a share of the measured DDTree step.

With dummy weights almost nothing is accepted, so these are costs per step, not speed.

    python benchmarks/bench_gpu_step.py                 # full plan (20-30 min on an H200)
    python benchmarks/bench_gpu_step.py --quick         # batch 1 and 8, budgets 16 and 64
    python benchmarks/bench_gpu_step.py --dry-run       # plan + synthetic table, no vLLM/CUDA
    python benchmarks/bench_gpu_step.py --shape kimi-k2.6 --budgets 8,16,32 --runners v2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_step_report import (  # noqa: E402 (the benchmarks folder is on sys.path)
    add_ratios,
    add_shares,
    describe,
    environment,
    gpu_query,
    save,
    share_table,
    step_table,
)
from gpu_step_timing import Sample, step_estimate, suspect_pairs, timed_generate

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_OUT = BENCH_DIR / "results" / "gpu_step.json"
DEFAULT_MODEL_DIR = Path(os.environ.get(
    "VLLM_DDTREE_CACHE", Path.home() / ".cache" / "vllm-ddtree")) / "gpu-step"

# Qwen3-8B's shape; the drafter follows z-lab's Qwen3-8B DFlash checkpoint.
VOCAB, LAYERS, BLOCK_SIZE, DRAFTER_LAYERS = 151936, 36, 16, 5
QWEN3_8B_SHAPE: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": VOCAB,
    "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MASK_TOKEN_ID, TARGET_LAYER_IDS = 151669, [1, 9, 17, 25, 33]
PROMPT_TOKEN_MAX = 151643  # ids below Qwen3's special tokens


@dataclass(frozen=True)
class Shape:
    """A target and its drafter as config.json files (vLLM fills dummy weights)."""

    name: str
    title: str  # the table's heading
    vocab: int
    layers: int  # the target's
    block_size: int  # the drafter's
    prompt_token_max: int  # prompts draw ids below this
    engine_kw: tuple[tuple[str, Any], ...] = ()  # further LLM(...) arguments


QWEN3_8B = Shape("qwen3-8b", "Qwen3-8B shape", VOCAB, LAYERS, BLOCK_SIZE, PROMPT_TOKEN_MAX)
KIMI_VOCAB, KIMI_BLOCK = 163840, 8
KIMI_DRAFTER = {"num_layers": 6, "num_heads": 64, "num_kv_heads": 8, "head_dim": 128,
                "intermediate_size": 18432, "mask_token_id": 163838}  # z-lab's Kimi drafters


def kimi_shape(moe_layers: int) -> Shape:
    return Shape("kimi-k2.6", f"Kimi K2.6 shape (1 dense + {moe_layers} MoE layers)",
                 KIMI_VOCAB, 1 + moe_layers, KIMI_BLOCK, KIMI_VOCAB - 256,
                 (("language_model_only", True),))


SHAPES = ("qwen3-8b", "kimi-k2.6")
MAX_CAPTURE = 4096  # largest CUDA-graph size (tokens) captured by default
# ddtree-triton / ddtree-flash: DDTree with ddtree_prefix_attention "triton" (the tree
# kernel alone) / "flash_attn" (FlashAttention 3 over the prefix at every batch), to
# compare with the default's "auto" in the same run.
PREFIX_METHODS = {"ddtree-triton": "triton", "ddtree-flash": "flash_attn"}
METHODS = ("plain", "chain", "ddtree", *PREFIX_METHODS)
ENGINE_START_S = 75  # torch.compile + graph capture of an 8B model on an H200: 60-90 s
_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[gpu-step {time.perf_counter() - _START:7.1f}s] {message}", flush=True)


# ---------------------------------------------------------------- arguments and plan


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: batches 1,8, budgets 16,64, outputs 16/64 tokens, 1 repeat")
    p.add_argument("--dry-run", action="store_true",
                   help="write the configs, print the plan and a synthetic table; no vLLM, no CUDA")
    p.add_argument("--batches", type=int_list, default=None, help="default 1,8,32")
    p.add_argument("--budgets", type=int_list, default=None, help="default 16,32,64,128,256")
    p.add_argument("--runners", type=name_list, default=["v1", "v2"],
                   help="model runners for plain and chain runs")
    p.add_argument("--ddtree-runners", type=name_list, default=["v2"],
                   help="model runners for DDTree runs: v2 (VLLM_USE_V2_MODEL_RUNNER=1; the "
                        "plugin's default on vLLM 0.33 with CUDA) and/or v1")
    p.add_argument("--methods", type=name_list, default=["plain", "chain", "ddtree"],
                   help=f"subset of {','.join(METHODS)} (to split a long run)")
    p.add_argument("--shape", choices=SHAPES, default="qwen3-8b",
                   help="target and drafter to time (module docstring)")
    p.add_argument("--moe-layers", type=int, default=2,
                   help="kimi-k2.6: MoE layers after the dense one (2 needs an H200)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--short-len", type=int, default=None, help="new tokens, short call (32)")
    p.add_argument("--long-len", type=int, default=None, help="new tokens, long call (160)")
    p.add_argument("--repeats", type=int, default=None, help="short/long pairs per batch (3)")
    p.add_argument("--max-model-len", type=int, default=None, help="default >= 4096, fits all")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    scheduling = p.add_mutually_exclusive_group()
    scheduling.add_argument("--sync-scheduling", action="store_true",
                            help="async_scheduling=False for every engine")
    scheduling.add_argument("--async-scheduling", action="store_true",
                            help="async_scheduling=True for every engine, DDTree's too "
                                 "(by default vLLM decides for plain and chain, and the "
                                 "plugin for DDTree: vLLM's choice on V2, without on V1)")
    p.add_argument("--all-capture-sizes", action="store_true",
                   help="let vLLM capture its default CUDA-graph sizes (slower start)")
    p.add_argument("--no-tree-ops", action="store_true", help="skip the plugin-share part")
    p.add_argument("--tree-ops-iters", type=int, default=None, help="default 20 (quick: 10)")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--merge", type=Path, default=None,
                   help="JSON of an earlier run: its engines join this table (those this "
                        "run measures again are replaced), for a plan split across calls")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON path (default {DEFAULT_OUT.relative_to(REPO)}; "
                        "dry run: MODEL_DIR/gpu_step_dry_run.json)")
    return resolve_defaults(p, p.parse_args(argv))


def resolve_defaults(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill what --quick changes, then reject values the plan cannot use."""
    quick = args.quick
    if args.moe_layers < 1:
        p.error(f"--moe-layers {args.moe_layers}: need >= 1")
    args.shape = QWEN3_8B if args.shape == "qwen3-8b" else kimi_shape(args.moe_layers)
    if args.shape.name == "kimi-k2.6" and not args.no_tree_ops:
        # bench_tree_ops times a dense KV cache's compaction, not MLA's latent one.
        args.no_tree_ops = True
    args.batches = args.batches or ([1, 8] if quick else [1, 8, 32])
    args.budgets = args.budgets or ([16, 64] if quick else [16, 32, 64, 128, 256])
    args.short_len = args.short_len or (16 if quick else 32)
    args.long_len = args.long_len or (64 if quick else 160)
    args.repeats = args.repeats or (1 if quick else 3)
    args.tree_ops_iters = args.tree_ops_iters or (10 if quick else 20)
    if args.long_len <= args.short_len:
        p.error(f"--long-len {args.long_len} must exceed --short-len {args.short_len}")
    if bad := sorted(set(args.runners) - {"v1", "v2"}):
        p.error(f"--runners: unknown {bad}; allowed v1, v2")
    if bad := sorted(set(args.ddtree_runners) - {"v1", "v2"}):
        p.error(f"--ddtree-runners: unknown {bad}; allowed v1, v2")
    if bad := sorted(set(args.methods) - set(METHODS)):
        p.error(f"--methods: unknown {bad}; allowed {', '.join(METHODS)}")
    if min(args.batches) < 1 or min(args.budgets) < 1 or args.prompt_len < 1:
        p.error("batches, budgets and --prompt-len must be >= 1")
    # Room for the prompt, the long output and the widest verify step's lookahead slots.
    need = args.prompt_len + args.long_len + max(args.budgets) + args.shape.block_size + 1
    args.max_model_len = args.max_model_len or max(4096, -(-need // 1024) * 1024)
    if args.max_model_len < need:
        p.error(f"--max-model-len {args.max_model_len} < {need} (prompt + output + budget)")
    args.max_num_seqs = max(32, max(args.batches))
    # vLLM's offline default on an H200 (16384) unless the widest verify batch needs more.
    args.max_num_batched_tokens = max(16384, max(args.batches) * (max(args.budgets) + 1))
    return args


@dataclass(frozen=True)
class EngineRun:
    """One engine: a model runner and a decoding method (a budget for DDTree)."""

    runner: str  # "v1" | "v2"
    method: str  # METHODS
    budget: int | None = None
    block: int = BLOCK_SIZE  # the drafter's block size

    @property
    def name(self) -> str:
        return f"{self.method}-b{self.budget}" if self.budget else self.method

    @property
    def speculative(self) -> bool:
        return self.method != "plain"

    def speculative_config(self, drafter: Path) -> dict[str, Any] | None:
        if self.method == "chain":  # the drafter's full block: bonus slot + 15 masks
            return {"method": "dflash", "model": str(drafter),
                    "num_speculative_tokens": self.block - 1}
        if self.method == "ddtree":
            return {"method": "ddtree", "model": str(drafter), "ddtree_budget": self.budget}
        if self.method in PREFIX_METHODS:
            return {"method": "ddtree", "model": str(drafter), "ddtree_budget": self.budget,
                    "ddtree_prefix_attention": PREFIX_METHODS[self.method]}
        return None


def load_previous(path: Path | None, runs: list[EngineRun]) -> tuple[list[dict], list[dict]]:
    """Engine records and tree-ops rows of an earlier call, minus the engines measured again."""
    if path is None:
        return [], []
    fresh = {(r.runner, r.method, r.budget) for r in runs}
    old = json.loads(path.read_text())
    kept = [r for r in old["runs"] if (r["runner"], r["method"], r["budget"]) not in fresh]
    for r in kept:
        r.setdefault("merged_from", str(path))
    log(f"merged {len(kept)} engine records and {len(old['tree_ops'])} tree-ops rows from {path}")
    return kept, old["tree_ops"]


def merge_ops(old: list[dict], new: list[dict]) -> list[dict]:
    fresh = {(r["batch"], r["budget"]) for r in new}
    rows = [r for r in old if (r["batch"], r["budget"]) not in fresh] + new
    return sorted(rows, key=lambda r: (r["batch"], r["budget"]))


def plan_runs(args: argparse.Namespace) -> list[EngineRun]:
    block = args.shape.block_size
    runs = [EngineRun(r, m, block=block) for r in args.runners for m in ("plain", "chain")
            if m in args.methods]
    for method in ("ddtree", *PREFIX_METHODS):
        if method in args.methods:
            runs += [EngineRun(r, method, b, block) for r in args.ddtree_runners
                     for b in args.budgets]
    return runs


def verify_width(run: EngineRun) -> int:
    """Query tokens per request in one verify step (the chain's is the drafter block)."""
    return {"plain": 1, "chain": run.block}.get(run.method, (run.budget or 0) + 1)


def guess_step_ms(run: EngineRun, batch: int, runner_factor: float = 1.0) -> float:
    """Toy cost model (fitted by eye to bench_tree_ops's H200 verify steps): weights
    read once, then about 0.031 ms per verify token; drafter and tree ops on top."""
    ms = 5.2 + 0.031 * batch * verify_width(run)
    if run.speculative:
        ms += 1.0 + 0.02 * batch  # one 5-layer drafter pass over 16 slots per request
    if run.method.startswith("ddtree"):
        ms += 1.3 + 0.07 * batch  # tree build + walk + compaction
    return ms * runner_factor


def print_plan(runs: list[EngineRun], drafter: Path, args: argparse.Namespace) -> None:
    steps = (1 + args.repeats) * (args.short_len + args.long_len)
    log(f"plan: {len(runs)} engines x batches {args.batches}; per batch 2 warm-ups "
        f"({args.short_len}, {args.long_len} tokens) + {args.repeats} x "
        f"({args.short_len}, {args.long_len}) "
        f"tokens; prompt {args.prompt_len} tokens, max_model_len {args.max_model_len}, "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}")
    total_s = 0.0
    for i, run in enumerate(runs, 1):
        decode_s = sum(steps * guess_step_ms(run, b) / 1e3 for b in args.batches)
        total_s += ENGINE_START_S + decode_s
        log(f"  {i:2d}. runner {run.runner}  {run.name:<12} "
            f"spec {json.dumps(run.speculative_config(drafter))}  "
            f"~{ENGINE_START_S} s start + ~{decode_s:.0f} s decoding")
    if not args.no_tree_ops:
        n = len(args.batches) * len(args.budgets) if "ddtree" in args.methods else 0
        total_s += 6 * n
        log(f"  tree ops: {n} (batch, budget) shapes, ~6 s each")
    log(f"rough total: {total_s / 60:.0f} min (engine starts counted at {ENGINE_START_S} s)")


# ----------------------------------------------------------------------- checkpoints


def write_models(model_dir: Path, shape: Shape = QWEN3_8B) -> tuple[Path, Path]:
    """config.json-only target and drafter; vLLM fills the weights (load_format=dummy)."""
    if shape.name == "kimi-k2.6":
        return write_kimi_models(model_dir, shape)
    target = model_dir / "qwen3-8b-shape-dummy"
    drafter = model_dir / f"dflash-qwen3-8b-shape-b{BLOCK_SIZE}-dummy"  # "dflash" in the path
    target_cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                  "num_hidden_layers": LAYERS, **QWEN3_8B_SHAPE}
    # The keys vllm_ddtree.checkpoints.tiny.make_dflash_drafter writes, at Qwen3-8B size.
    drafter_cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                   "num_hidden_layers": DRAFTER_LAYERS, **QWEN3_8B_SHAPE,
                   "block_size": BLOCK_SIZE, "num_target_layers": LAYERS,
                   "dflash_config": {"mask_token_id": MASK_TOKEN_ID,
                                     "target_layer_ids": TARGET_LAYER_IDS}}
    for path, cfg in ((target, target_cfg), (drafter, drafter_cfg)):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return target, drafter


def write_kimi_models(model_dir: Path, shape: Shape) -> tuple[Path, Path]:
    """Kimi K2.6's text model cut to ``shape.layers`` layers, and a drafter in the shape
    of z-lab's Kimi drafters that reads every one of them (their six target layers
    need a full-depth target)."""
    from vllm_ddtree.checkpoints import mla, tiny

    target = model_dir / f"kimi-k2.6-shape-{shape.layers}l-dummy"
    drafter = model_dir / f"dflash-kimi-k2.6-shape-{shape.layers}l-b{shape.block_size}-dummy"
    mla.make_kimi_k25_target(target, weights=False,
                             **{**mla.KIMI_K2_TEXT, "num_hidden_layers": shape.layers})
    tiny.make_dflash_drafter(drafter, target, shape.block_size, weights=False,
                             target_layer_ids=list(range(shape.layers)),
                             rope_scaling=mla.KIMI_K2_TEXT["rope_scaling"], **KIMI_DRAFTER)
    return target, drafter


def make_prompts(batch: int, prompt_len: int,
                 token_max: int = PROMPT_TOKEN_MAX) -> list[dict[str, list[int]]]:
    """Distinct fixed-seed token-id prompts (vLLM's TokensPrompt is this dict)."""
    return [{"prompt_token_ids": [random.Random(i).randrange(token_max)
                                  for _ in range(prompt_len)]} for i in range(batch)]


# --------------------------------------------------------------------- measurement


def measure_batch(run_call: Callable[[list[dict], int], Sample], run: EngineRun, batch: int,
                  args: argparse.Namespace) -> dict:
    prompts = make_prompts(batch, args.prompt_len, args.shape.prompt_token_max)
    # Warm-up: first use of this batch's shapes, and it fills the prefix cache so both
    # timed calls prefill the same (cached) way; a second call runs that cached path
    # once untimed (its first use once cost a one-time 0.35 s in the short call of a
    # DDTree pair, which the difference of the pair turned into a step time of ~0), as
    # long as the long call, so every context length the timed calls reach has met the
    # kernels once (a kernel variant first compiled inside a timed call made a batch-32
    # DDTree pair negative).
    run_call(prompts, args.short_len)
    run_call(prompts, args.long_len)
    pairs = [(run_call(prompts, args.short_len), run_call(prompts, args.long_len))
             for _ in range(args.repeats)]
    estimates = [step_estimate(s, lg, batch, run.speculative) for s, lg in pairs]
    row: dict[str, Any] = {"batch": batch}
    for key in ("ms_per_step", "tokens_per_step", "ms_per_token", "ms_per_iteration"):
        row[key] = statistics.median(e[key] for e in estimates)
    row["steps_per_pair"] = estimates[0]["steps"]
    row["estimates"] = estimates
    row["samples"] = [[asdict(s), asdict(lg)] for s, lg in pairs]
    note = suspect_pairs(estimates)
    if note:
        row["suspect"] = note
        log(f"    warning: {note}")
    if row["steps_per_pair"] < 16:
        log(f"    warning: only {row['steps_per_pair']:.1f} steps between the two lengths "
            "(high acceptance?): raise --long-len")
    return row


def make_engine(run: EngineRun, target: Path, drafter: Path, args: argparse.Namespace):
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(target), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
        max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0, disable_log_stats=False, speculative_config=run.speculative_config(drafter),
        **dict(args.shape.engine_kw))
    kwargs.update(scheduling_kwargs(args))
    if not args.all_capture_sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": capture_sizes(run, args)}
    return LLM(**kwargs)


def scheduling_kwargs(args: argparse.Namespace) -> dict[str, bool]:
    """The engines' async_scheduling: one setting for all, or each engine's default."""
    if args.sync_scheduling:
        return {"async_scheduling": False}
    if args.async_scheduling:
        return {"async_scheduling": True}
    return {}


def capture_sizes(run: EngineRun, args: argparse.Namespace) -> list[int]:
    """CUDA-graph sizes this plan uses: verify (and drafter) widths x batches.

    Capturing only these keeps each engine's start short; steps above
    MAX_CAPTURE tokens run the compiled model without graphs, as vLLM does
    past its own largest size."""
    widths = {verify_width(run)} | ({run.block} if run.speculative else set())
    sizes = {w * b for w in widths for b in args.batches}
    return sorted(x for x in sizes if x <= MAX_CAPTURE) or [1]


def engine_facts(llm) -> dict[str, Any]:
    """Settings vLLM resolved itself, which decide what a step costs."""
    cfg = llm.llm_engine.vllm_config
    probes = {
        "async_scheduling": lambda: cfg.scheduler_config.async_scheduling,
        "max_num_batched_tokens": lambda: cfg.scheduler_config.max_num_batched_tokens,
        "cudagraph_mode": lambda: str(cfg.compilation_config.cudagraph_mode),
        "max_cudagraph_capture_size": lambda: cfg.compilation_config.max_cudagraph_capture_size,
        "num_cudagraph_sizes": lambda: len(cfg.compilation_config.cudagraph_capture_sizes),
        "kv_block_size": lambda: cfg.cache_config.block_size,
        "num_gpu_blocks": lambda: cfg.cache_config.num_gpu_blocks,
        "enable_prefix_caching": lambda: cfg.cache_config.enable_prefix_caching,
    }
    facts = {}
    for key, probe in probes.items():
        try:
            facts[key] = probe()
        except Exception:  # attribute moved in another vLLM version: record nothing
            facts[key] = None
    return facts


def shutdown_engine(llm) -> None:
    """Stop the engine-core process now, so the next engine gets the GPU memory."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:
        log(f"  shutdown: {exc!r}")


def wait_for_gpu_release(timeout_s: float = 90.0) -> None:
    """Poll nvidia-smi (no CUDA context here) until the last engine's memory is back;
    the next engine asks for 85% of the GPU and fails if it is not free yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = gpu_query("memory.used,memory.total")
        if used is None:
            time.sleep(5)
            return
        mib, total = (float(x) for x in used.split(","))
        if mib < 0.1 * total or time.monotonic() > deadline:
            if mib >= 0.1 * total:
                log(f"  GPU memory still {mib:.0f} of {total:.0f} MiB in use")
            return
        time.sleep(1)


def new_record(run: EngineRun, drafter: Path) -> dict[str, Any]:
    return {"runner": run.runner, "method": run.method, "budget": run.budget,
            "speculative_config": run.speculative_config(drafter), "rows": [], "error": None}


def run_engine(run: EngineRun, target: Path, drafter: Path, args: argparse.Namespace) -> dict:
    """Start one engine, measure every batch, shut it down; errors become records."""
    record = new_record(run, drafter)
    # The engine core is a fresh process that reads this when it starts.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if run.runner == "v2" else "0"
    start = time.perf_counter()
    log(f"engine {run.runner} {run.name}: starting")
    try:
        llm = make_engine(run, target, drafter, args)
    except Exception as exc:
        record.update(error=f"engine start: {describe(exc)}", traceback=traceback.format_exc())
        print(record["traceback"], flush=True)
        return record
    record["start_s"] = time.perf_counter() - start
    record["engine"] = engine_facts(llm)
    log(f"engine {run.runner} {run.name}: up in {record['start_s']:.0f} s {record['engine']}")

    def call(prompts: list[dict], max_tokens: int) -> Sample:
        return timed_generate(llm, prompts, max_tokens)

    try:
        for batch in args.batches:
            try:
                row = measure_batch(call, run, batch, args)
                log(f"  batch {batch}: {row['ms_per_step']:.3f} ms/step, "
                    f"{row['tokens_per_step']:.2f} tokens/step")
            except Exception as exc:
                row = {"batch": batch, "error": describe(exc), "traceback": traceback.format_exc()}
                print(row["traceback"], flush=True)
            record["rows"].append(row)
    finally:
        shutdown_engine(llm)
        llm = None  # the closure's cell too: the engine can be collected
        gc.collect()
    record["total_s"] = time.perf_counter() - start
    return record


# ------------------------------------------------------------------- plugin share


def tree_ops_args(ops_bench, args: argparse.Namespace) -> argparse.Namespace:
    """bench_tree_ops's own arguments at this run's shapes."""
    return ops_bench.parse_args([
        "--max-depth", str(args.shape.block_size - 1), "--vocab", str(args.shape.vocab),
        "--layers", str(args.shape.layers),
        "--context", str(args.prompt_len), "--page-size", "16",
        "--iters", str(args.tree_ops_iters)])


def import_tree_ops():
    sys.path.insert(0, str(BENCH_DIR))
    import bench_tree_ops

    return bench_tree_ops


def run_tree_ops(args: argparse.Namespace) -> list[dict]:
    """Tree ops per step at every (batch, budget). Runs after the last engine: CUDA
    starts in this process only now, so no engine had to share the GPU with it."""
    ops_bench = import_tree_ops()
    ops_args = tree_ops_args(ops_bench, args)
    rows = []
    for batch in args.batches:
        for budget in args.budgets:
            log(f"tree ops: batch {batch}, budget {budget}")
            try:
                rows.append(ops_bench.measure_ops(batch, budget, ops_args))
            except Exception as exc:
                rows.append({"batch": batch, "budget": budget, "error": describe(exc),
                             "traceback": traceback.format_exc()})
                print(rows[-1]["traceback"], flush=True)
            ops_bench.torch.cuda.empty_cache()
    return rows


# -------------------------------------------------------------------------- dry run


def fake_call(run: EngineRun, batch: int, args: argparse.Namespace):
    """A stand-in for generate() from the toy cost model: the summarising, table and
    JSON code runs on it exactly as on real samples."""
    def call(prompts: list[dict], max_tokens: int) -> Sample:
        factor = 0.95 if run.runner == "v2" else 1.0
        steps = max_tokens - 1  # the prefill step gives the first token
        seconds = 0.05 * batch + steps * guess_step_ms(run, batch, factor) / 1e3
        drafts = batch * steps if run.speculative else 0
        return Sample(max_tokens, seconds, batch * max_tokens, drafts, drafts // 20,
                      steps + 2)
    return call


def fake_tree_ops(args: argparse.Namespace) -> list[dict]:
    ops_bench = import_tree_ops()
    tree_ops_args(ops_bench, args)  # check the reuse path: parser and entry point exist
    if not callable(getattr(ops_bench, "measure_ops", None)):
        raise RuntimeError("bench_tree_ops.measure_ops is gone; update run_tree_ops")
    return [{"batch": b, "budget": k, "ops_graph_ms": 1.3 + 0.07 * b,
             "ops_eager_ms": 5.0 + 0.08 * b, "build_graph_ms": 0.3 + 0.07 * b,
             "walk_graph_ms": 0.3, "compact_graph_ms": 0.7, "walk_eager_ms": 2.4,
             "compact_eager_ms": 2.3}
            for b in args.batches for k in args.budgets]


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = args.out or (args.model_dir / "gpu_step_dry_run.json" if args.dry_run else DEFAULT_OUT)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local paths only; never wait on a hub
    target, drafter = write_models(args.model_dir, args.shape)
    log(f"target {target}\n          drafter {drafter}")
    runs = plan_runs(args)
    print_plan(runs, drafter, args)
    env = environment(args.dry_run)
    records, ops_rows = load_previous(args.merge, runs)
    for i, run in enumerate(runs, 1):
        log(f"[{i}/{len(runs)}] {run.runner} {run.name}")
        if args.dry_run:
            record = new_record(run, drafter)
            record["rows"] = [measure_batch(fake_call(run, b, args), run, b, args)
                              for b in args.batches]
        else:
            record = run_engine(run, target, drafter, args)
            gc.collect()
            wait_for_gpu_release()
        records.append(record)
        add_ratios(records)
        save(out, args, records, ops_rows, env)
    if not args.no_tree_ops and any(r["method"] == "ddtree" for r in records):
        new_ops = fake_tree_ops(args) if args.dry_run else run_tree_ops(args)
        ops_rows = merge_ops(ops_rows, new_ops)
    add_shares(ops_rows, records)
    env = environment(args.dry_run)  # again, now naming the vLLM and torch that ran
    save(out, args, records, ops_rows, env)
    title = "DRY RUN: synthetic numbers from a toy cost model, not measurements. " \
        if args.dry_run else ""
    print(f"\n## {title}Step cost, {args.shape.title}, dummy weights, prompt {args.prompt_len}, "
          f"{env['gpu'] or 'GPU ?'}, vLLM {env['vllm']}\n")
    print(step_table(records))
    if ops_rows:
        print("\n## DDTree tree ops (bench_tree_ops.measure_ops) as a share of the DDTree step\n")
        print(share_table(ops_rows))
    log(f"wrote {out}")
    return {"runs": records, "tree_ops": ops_rows}


if __name__ == "__main__":
    main()
