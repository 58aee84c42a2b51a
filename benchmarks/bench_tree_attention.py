"""Tree attention (Triton) against dense causal attention with the same queries.

For every (context, batch, budget): each request has a prefix of `context` tokens and
budget + 1 verify queries (Qwen3-8B heads: 32 query / 8 KV heads, head_dim 128, bf16,
paged KV with 16-token pages). Timed, as CUDA-graph replays (median):
- tree:  vllm_ddtree.kernels.tree_attention.tree_attention_triton, random trees
         (depth <= 15) in build_ddtree's preorder layout (--tree-layout), packed masks;
- fa3:   FlashAttention 3 from vLLM's wheel (`_vllm_fa3_C`), causal, same paged cache
         (only when --fa3-so points at the extension);
- split: what the FLASH_ATTN backend runs (ddtree_prefix_attention "flash_attn"): FA3
         non-causal over each prefix alone, returning its LSE, then the tree kernel
         over the tree keys from that partial result (needs --fa3-so too); its output
         is checked against the tree kernel's. Its plan is made once, as a step's
         layers share it, so where the tree pass walks each query tile's listed keys
         (tile_keys_triton.py) their listing, once per step, is timed on its own
         (`lists ms`);
- sdpa:  torch SDPA, flash backend, contiguous K/V, non-causal (torch's flash causal
         mask is top-left aligned, which would skip the prefix); GQA via enable_gqa.
Prints a table and writes JSON (--out). ``--sweep`` also times other tile configs of
the tree kernel; ``--split-sweep`` instead times only the split, its tree pass under
each of SPLIT_SWEEP_TILES, on SPLIT_SWEEP_SHAPES.

    python benchmarks/bench_tree_attention.py --fa3-so build/fa3/_vllm_fa3_C.abi3.so.xz
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import lzma
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_ddtree.ops.tree import ancestor_mask_from_parents, preorder_layout
from vllm_ddtree.tensors import DDTree, pack_tree_mask


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768])
    p.add_argument("--batches", type=int_list, default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=int_list, default=[16, 64, 256])
    p.add_argument("--heads", type=int_list, default=[32, 8], help="query,kv heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-depth", type=int, default=15)
    p.add_argument("--tree-layout", choices=["preorder", "generated"], default="preorder",
                   help="node order of the random trees: the plugin's (preorder, default) "
                        "or the generation order (parents among the 64 nodes before)")
    p.add_argument("--fa3-so", default=None, help="_vllm_fa3_C.abi3.so (or .xz)")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also try other tile configs")
    p.add_argument("--sweep-budget-s", type=float, default=60.0)
    p.add_argument("--split-sweep", action="store_true",
                   help="time tile configs for the tree pass of the split (needs --fa3-so)")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out", default=None,
                   help="JSON file; default benchmarks/results/tree_attention_h200.json, "
                        "or tree_attention_split_sweep_h200.json with --split-sweep")
    args = p.parse_args(argv)
    if args.out is None:
        name = "tree_attention_split_sweep_h200" if args.split_sweep else "tree_attention_h200"
        args.out = f"benchmarks/results/{name}.json"
    return args


def load_fa3(path: str | None):
    """Load vLLM's FA3 extension alone (no vllm import); returns torch.ops namespace."""
    if not path:
        return None
    if path.endswith(".xz"):
        target = "/tmp/fa3/_vllm_fa3_C.abi3.so"
        if not os.path.exists(target):
            os.makedirs("/tmp/fa3", exist_ok=True)
            with lzma.open(path) as src, open(target, "wb") as dst:
                dst.write(src.read())
        path = target
    spec = importlib.util.spec_from_file_location("_vllm_fa3_C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return torch.ops._vllm_fa3_C


def fa3_call(ops, q, k_cache, v_cache, out, cu_q, seq_lens, block_table, max_q, max_k, scale,
             causal: bool = True):
    """flash_attn_varlen_func(fa_version=3) with a paged cache; returns (out, lse)."""
    out, lse, *_ = ops.fwd(
        q, k_cache, v_cache, None, None, None, out, cu_q, None, None, None, seq_lens,
        max_q, max_k, block_table, None, None, None, None, None, None, None, None,
        scale, causal, -1, -1, 0.0, True, None, 0, None, 0, None, 1, 0, None,
    )
    return out, lse


def random_tree_mask(n: int, max_depth: int, seed: int,
                     layout: str = "preorder") -> torch.Tensor:  # [n, n] bool
    """Ancestor mask of a random tree: each node's parent is one of the 64 nodes before it
    (depth <= max_depth). ``layout="preorder"`` renumbers it as build_ddtree lays out its
    trees (tree.preorder_layout); ``"generated"`` keeps the generation order."""
    rng = random.Random(seed)
    parents, depths = [0], [0]
    for node in range(1, n):
        parent = rng.choice([j for j in range(max(0, node - 64), node) if depths[j] < max_depth] or [0])
        parents.append(parent)
        depths.append(depths[parent] + 1)
    parents_t = torch.tensor([parents])
    mask = ancestor_mask_from_parents(parents_t, max_depth)
    if layout == "generated":
        return mask[0]
    tree = DDTree(tokens=torch.zeros_like(parents_t), parents=parents_t,
                  depths=torch.tensor([depths]), valid=torch.ones_like(parents_t, dtype=torch.bool),
                  ancestor_mask=mask, num_nodes=torch.tensor([n - 1]))
    return preorder_layout(tree).ancestor_mask[0]


def bench(fn, rep_ms: int) -> float:
    """Median ms of CUDA-graph replays (falls back to plain launches)."""
    import triton.testing as tt

    try:
        return tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    except Exception as exc:  # noqa: BLE001
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
        return tt.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


class Case:
    """Paged cache for `batch` requests of up to `context + max_n` tokens."""

    def __init__(self, context: int, batch: int, max_n: int, args, dtype=torch.bfloat16):
        num_kv_heads = args.heads[1]
        page = args.page_size
        dev = "cuda"
        self.context, self.batch, self.args = context, batch, args
        pages = -(-(context + max_n) // page)
        num_blocks = batch * pages
        self.key_cache = torch.randn(num_blocks, page, num_kv_heads, args.head_dim, device=dev, dtype=dtype)
        self.value_cache = torch.randn_like(self.key_cache)
        perm = torch.randperm(num_blocks, device=dev, dtype=torch.int32)
        self.block_table = perm.view(batch, pages)
        self.scale = args.head_dim**-0.5

    def inputs(self, n: int, seed: int):
        num_heads, _ = self.args.heads
        batch, dev = self.batch, "cuda"
        seq = self.context + n
        q = torch.randn(batch * n, num_heads, self.args.head_dim, device=dev, dtype=self.key_cache.dtype)
        seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
        cu_q = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=dev)
        mask = random_tree_mask(n, self.args.max_depth, seed, self.args.tree_layout).to(dev)
        packed = pack_tree_mask(mask[None].expand(batch, n, n).contiguous())
        return q, seq_lens, cu_q, packed


def dense_kv(case: Case, seq: int):
    """Contiguous [batch, kv_heads, seq, head_dim] K/V gathered from the paged cache."""
    page = case.args.page_size
    pos = torch.arange(seq, device="cuda")
    blocks = case.block_table[:, pos // page].long()  # [batch, seq]
    k = case.key_cache[blocks, pos % page].transpose(1, 2).contiguous()
    v = case.value_cache[blocks, pos % page].transpose(1, 2).contiguous()
    return k, v


def run_case(case: Case, budget: int, fa3, args, results: list[dict]) -> None:
    from vllm_ddtree.kernels.tree_attention import tree_attention_triton
    from vllm_ddtree.kernels.tree_attention_plan import (
        choose_num_splits,
        pick_tile_config,
    )

    n = budget + 1
    seq = case.context + n
    num_heads, num_kv_heads = args.heads
    q, seq_lens, cu_q, packed = case.inputs(n, seed=budget)
    out = torch.empty_like(q)

    def tree():
        tree_attention_triton(
            q, case.key_cache, case.value_cache, case.block_table, seq_lens, cu_q,
            packed, case.scale, max_query_len=n, max_seq_len=seq, out=out,
        )

    row = {"context": case.context, "batch": case.batch, "budget": budget, "queries": n}
    row["tree_ms"] = bench(tree, args.rep_ms)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    group = num_heads // num_kv_heads
    cfg = pick_tile_config(args.head_dim, group, q.dtype, n, case.batch * num_kv_heads, num_sms)
    tiles = -(-n // (cfg.block_m // group))
    row["splits"] = choose_num_splits(case.batch * num_kv_heads * tiles, seq, num_sms)
    row["config"] = list(cfg.__dict__.values())
    # Useful work: QK^T and PV over prefix + causal half of the tree, for every head.
    flops = 4 * case.batch * n * num_heads * args.head_dim * (case.context + (n + 1) / 2)
    kv_bytes = 2 * case.batch * seq * num_kv_heads * args.head_dim * q.element_size()
    row["tree_tflops"] = flops / row["tree_ms"] / 1e9
    row["tree_tbps"] = kv_bytes / row["tree_ms"] / 1e9
    if fa3 is not None:
        fa_out = torch.empty_like(q)

        def dense_fa3():
            fa3_call(fa3, q, case.key_cache, case.value_cache, fa_out, cu_q, seq_lens,
                     case.block_table, n, seq, case.scale)

        row["fa3_ms"] = bench(dense_fa3, args.rep_ms)
        row["tree_over_fa3"] = row["tree_ms"] / row["fa3_ms"]
        time_split(case, q, seq_lens, cu_q, packed, n, seq, fa3, out, args, row)
    if not args.no_sdpa:
        k, v = dense_kv(case, seq)
        qd = q.view(case.batch, n, num_heads, -1).transpose(1, 2)
        row["sdpa_ms"], row["sdpa_backend"] = time_sdpa(qd, k, v, case.scale, args.rep_ms)
        if row["sdpa_ms"] is None:
            del row["sdpa_ms"]
        else:
            row["tree_over_sdpa"] = row["tree_ms"] / row["sdpa_ms"]
        del k, v
    results.append(row)
    print(format_row(row), flush=True)


def split_call(case: Case, q, seq_lens, cu_q, packed, n: int, seq: int, fa3, out,
               config=None):
    """What the FLASH_ATTN backend runs, as one callable: FA3 over the prefixes alone
    into ``out``, then the tree kernel (``config``, or its own pick) over the trees."""
    from vllm_ddtree.kernels.tree_attention import launch_tree_attention
    from vllm_ddtree.kernels.tree_attention_plan import plan_tree_attention

    prefix_lens = seq_lens - n
    plan = plan_tree_attention(
        q, case.key_cache, case.value_cache, case.block_table, seq_lens, cu_q, packed,
        case.scale, max_query_len=n, max_seq_len=seq, out=out, prefix_given=True,
        config=config,
    )

    def split():
        _, lse = fa3_call(fa3, q, case.key_cache, case.value_cache, out, cu_q,
                          prefix_lens, case.block_table, n, seq, case.scale, causal=False)
        launch_tree_attention(plan, q, case.key_cache, case.value_cache, out, lse)

    split.plan = plan  # made once, as a step's layers share it (key lists included)
    return split


def time_split(case: Case, q, seq_lens, cu_q, packed, n: int, seq: int, fa3, tree_out,
               args, row: dict) -> None:
    """FA3 over the prefixes, then the tree kernel over the trees (prefix given)."""
    split_out = torch.empty_like(q)
    split = split_call(case, q, seq_lens, cu_q, packed, n, seq, fa3, split_out)
    split()
    row["split_max_diff"] = (split_out.float() - tree_out.float()).abs().max().item()
    row["split_ms"] = bench(split, args.rep_ms)
    plan = split.plan
    if plan.tile_keys is not None:  # made once per step for all layers: not in split_ms
        from vllm_ddtree.kernels.tile_keys import list_tile_keys

        tokens, tiles = plan.constexprs["TOKENS_PER_TILE"], plan.grid[0]
        row["key_lists_ms"] = bench(lambda: list_tile_keys(packed, cu_q, tokens, tiles),
                                    args.rep_ms)
    row["split_over_fa3"] = row["split_ms"] / row["fa3_ms"]
    row["best_over_fa3"] = min(row["tree_ms"], row["split_ms"]) / row["fa3_ms"]


def time_sdpa(q, k, v, scale: float, rep_ms: int) -> tuple[float | None, str]:
    """First SDPA backend that runs GQA (flash, then cuDNN, then memory-efficient)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    errors = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def dense(backend=backend):
            with sdpa_kernel(backend):
                sdpa(q, k, v, scale=scale, enable_gqa=True)

        try:
            dense()
            return bench(dense, rep_ms), backend.name
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{backend.name}: {type(exc).__name__}: {str(exc)[:120]}")
    return None, "; ".join(errors)


HEADER = (f"{'ctx':>6} {'batch':>5} {'B':>4} {'splits':>6} {'tree ms':>9} {'split ms':>9} "
          f"{'fa3 ms':>9} {'sdpa ms':>9} {'tree/fa3':>8} {'split/fa3':>9} {'tree/sdpa':>9} "
          f"{'TFLOP/s':>8} {'TB/s':>6} {'lists ms':>8}")


def format_row(r: dict) -> str:
    def f(key: str, spec: str) -> str:
        return format(r[key], spec) if key in r else "-"

    return (
        f"{r['context']:>6} {r['batch']:>5} {r['budget']:>4} {r['splits']:>6} "
        f"{f('tree_ms', '9.4f'):>9} {f('split_ms', '9.4f'):>9} {f('fa3_ms', '9.4f'):>9} "
        f"{f('sdpa_ms', '9.4f'):>9} {f('tree_over_fa3', '8.2f'):>8} "
        f"{f('split_over_fa3', '9.2f'):>9} {f('tree_over_sdpa', '9.2f'):>9} "
        f"{f('tree_tflops', '8.1f'):>8} {f('tree_tbps', '6.2f'):>6} "
        f"{f('key_lists_ms', '8.4f'):>8}"
    )


SWEEP_SHAPES = [  # (context, batch, budget)
    (32768, 1, 16), (32768, 8, 16), (32768, 64, 16), (32768, 8, 64),
    (8192, 32, 64), (4096, 64, 256), (1024, 8, 256), (1024, 1, 64), (1024, 1, 256),
    (4096, 1, 64),
]


def sweep(args, fa3) -> list[dict]:
    """Time other tile configs on three shapes; each must match the default's output."""
    from vllm_ddtree.kernels.tree_attention import tree_attention_triton
    from vllm_ddtree.kernels.tree_attention_plan import TileConfig

    configs = [TileConfig(*c) for c in [
        (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
        (64, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 4), (64, 64, 4, 2), (32, 64, 4, 2),
        (64, 128, 4, 2), (32, 32, 4, 2),
    ]]
    rows = []
    started = time.time()
    for context, batch, budget in SWEEP_SHAPES:
        if time.time() - started > args.sweep_budget_s:
            print("sweep: out of time, skipping the remaining shapes")
            break
        case = Case(context, batch, budget + 1, args)
        n, seq = budget + 1, context + budget + 1
        q, seq_lens, cu_q, packed = case.inputs(n, seed=budget)
        ref = None
        for cfg in configs:
            out = torch.empty_like(q)
            tree = functools.partial(
                tree_attention_triton, q, case.key_cache, case.value_cache,
                case.block_table, seq_lens, cu_q, packed, case.scale,
                max_query_len=n, max_seq_len=seq, out=out, config=cfg,
            )
            try:
                tree()
                ms = bench(tree, args.rep_ms)
            except Exception as exc:  # noqa: BLE001
                print(f"sweep {context} {batch} {budget} {cfg}: {type(exc).__name__}")
                continue
            ref = out.clone() if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            row = {
                "context": context, "batch": batch, "budget": budget,
                "config": list(cfg.__dict__.values()), "ms": ms, "max_diff_vs_first": err,
            }
            rows.append(row)
            print(f"sweep ctx={context} batch={batch} B={budget} {cfg}: {ms:.4f} ms (diff {err:.1e})", flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


SPLIT_SWEEP_SHAPES = [  # (context, batch, budget)
    (1024, 1, 16), (1024, 1, 64), (1024, 1, 256), (1024, 8, 16), (1024, 8, 64), (1024, 8, 256),
    (1024, 32, 16), (1024, 32, 64), (1024, 32, 256), (1024, 64, 256), (4096, 1, 16),
    (4096, 1, 64), (4096, 1, 256), (4096, 8, 256), (16384, 1, 16), (16384, 8, 64),
    (32768, 32, 256),
]
SPLIT_SWEEP_TILES = [  # tiled kernel: (block_m, block_n, num_warps, num_stages)
    (16, 32, 2, 1), (32, 32, 4, 1), (64, 16, 4, 1), (64, 32, 4, 1), (128, 32, 4, 1),
]


def split_sweep(args, fa3) -> list[dict]:
    """The split's tree pass under other tile configs: FA3 over the prefixes alone, FA3
    dense causal, and prefix + tree pass per config (output checked against the tree
    kernel alone)."""
    from vllm_ddtree.kernels.tree_attention import tree_attention_triton
    from vllm_ddtree.kernels.tree_attention_plan import TileConfig

    rows = []
    for context, batch, budget in SPLIT_SWEEP_SHAPES:
        print(f"split sweep ctx={context} batch={batch} B={budget} ...", flush=True)
        case = Case(context, batch, budget + 1, args)
        n, seq = budget + 1, context + budget + 1
        q, seq_lens, cu_q, packed = case.inputs(n, seed=budget)
        ref = tree_attention_triton(
            q, case.key_cache, case.value_cache, case.block_table, seq_lens, cu_q, packed,
            case.scale, max_query_len=n, max_seq_len=seq,
        )
        out = torch.empty_like(q)
        fa_out = torch.empty_like(q)
        prefix = functools.partial(
            fa3_call, fa3, q, case.key_cache, case.value_cache, out, cu_q, seq_lens - n,
            case.block_table, n, seq, case.scale, causal=False)
        dense = functools.partial(
            fa3_call, fa3, q, case.key_cache, case.value_cache, fa_out, cu_q, seq_lens,
            case.block_table, n, seq, case.scale)
        row = {"context": context, "batch": batch, "budget": budget,
               "prefix_ms": bench(prefix, args.rep_ms), "fa3_ms": bench(dense, args.rep_ms),
               "configs": []}
        for cfg in [None] + [TileConfig(*c) for c in SPLIT_SWEEP_TILES]:
            try:
                split = split_call(case, q, seq_lens, cu_q, packed, n, seq, fa3, out, cfg)
                split()
                ms = bench(split, args.rep_ms)
            except Exception as exc:  # noqa: BLE001
                print(f"split sweep {context} {batch} {budget} {cfg}: {type(exc).__name__}")
                continue
            diff = (out.float() - ref.float()).abs().max().item()
            print(f"  {cfg}: {ms:.4f} ms", flush=True)
            name = "default" if cfg is None else list(cfg.__dict__.values())
            row["configs"].append({"config": name, "split_ms": ms, "max_diff": diff})
        best = min(row["configs"], key=lambda c: c["split_ms"])
        default = row["configs"][0]
        print(f"split sweep ctx={context} batch={batch} B={budget}: prefix {row['prefix_ms']:.4f} "
              f"fa3 {row['fa3_ms']:.4f} default {default['split_ms']:.4f} "
              f"({default['split_ms'] / row['fa3_ms']:.2f}x) best {best['config']} "
              f"{best['split_ms']:.4f} ({best['split_ms'] / row['fa3_ms']:.2f}x, "
              f"diff {best['max_diff']:.1e})", flush=True)
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_tree_attention needs a CUDA GPU")
    fa3 = load_fa3(args.fa3_so)
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"fa3 {'yes' if fa3 else 'no'}  heads {args.heads}  head_dim {args.head_dim}  bf16  "
          f"trees {args.tree_layout}")
    results: list[dict] = []
    sweep_rows: list[dict] = []
    started = time.time()
    if args.split_sweep:
        if fa3 is None:
            raise SystemExit("--split-sweep needs --fa3-so")
        sweep_rows = split_sweep(args, fa3)
        save(args, fa3, results, sweep_rows)
        print(f"wrote {args.out}")
        return
    print(HEADER)
    for context in args.contexts:
        for batch in args.batches:
            case = Case(context, batch, max(args.budgets) + 1, args)
            for budget in args.budgets:
                run_case(case, budget, fa3, args, results)
                save(args, fa3, results, sweep_rows)  # partial results survive a timeout
            del case
            torch.cuda.empty_cache()
    print(f"\n== tree attention vs dense, H200 ({time.time() - started:.0f} s) ==")
    print(HEADER)
    for row in results:
        print(format_row(row))
    if args.sweep:
        sweep_rows = sweep(args, fa3)
        save(args, fa3, results, sweep_rows)
    print(f"wrote {args.out}")


def save(args, fa3, results: list[dict], sweep_rows: list[dict]) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "heads": args.heads, "head_dim": args.head_dim, "page_size": args.page_size,
            "dtype": "bfloat16", "fa3": fa3 is not None, "tree_layout": args.tree_layout,
            "timing": "median CUDA-graph replay (ms)",
            "results": results, "sweep": sweep_rows,
        }, f, indent=1)

if __name__ == "__main__":
    main()
