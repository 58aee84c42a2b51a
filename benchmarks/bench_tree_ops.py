"""Per-step cost of the DDTree host-side tensor ops next to a Qwen3-8B-shaped step.

Tree ops = build_ddtree (top-K per depth over the vocabulary + best-prefix selection)
+ walk_tree + compaction as vllm_ddtree/runner/common.py does it on CUDA: one launch for the
KV moves of every layer's paged cache (vLLM's CUDA layout), the hidden-state and
token-id rows, and the positions back in chain order (compact_step_triton). Timed eagerly (host wall time per
call, synchronised) and as a CUDA-graph replay, with a per-op eager breakdown.

The step estimate is measured in the same run: one verify forward of a Qwen3-8B-shaped
model (36 layers of bf16 GEMMs, hidden 4096, intermediate 12288, 32 query / 8 KV heads
of 128, vocabulary 151936) over batch x (budget + 1) tokens, with the Triton tree
attention over a `--context`-token paged prefix per layer, captured in a CUDA graph.
Norms, RoPE and the KV write are left out (a few percent of the step). A plain decode
step (batch tokens, no tree) is timed too for scale.

    python benchmarks/bench_tree_ops.py --batches 1,32 --budgets 16,64,256
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_ddtree.config import topk_width
from vllm_ddtree.kernels.compact_step import compact_step_triton
from vllm_ddtree.ops.tree import _topk_and_repair, build_ddtree, topk_per_depth
from vllm_ddtree.ops.walk import walk_tree

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 4096, 12288, 32, 8, 128, 151936, 36
DEVICE = "cuda"  # --cpu-dry-run switches to "cpu" (logic check only, with TRITON_INTERPRET=1)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int_list, default=[1, 32])
    p.add_argument("--budgets", type=int_list, default=[16, 64, 256])
    p.add_argument("--max-depth", type=int, default=15, help="DFlash block size - 1")
    p.add_argument("--topk-cap", type=int, default=None,
                   help="ddtree_topk_cap (default none: k = budget)")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--context", type=int, default=4096, help="prefix tokens per request")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cpu-dry-run", action="store_true", help="check the script on a CPU")
    p.add_argument("--out", default="benchmarks/results/tree_ops_h200.json")
    return p.parse_args(argv)


def wall_ms(fn, iters: int) -> float:
    """Median host wall time of fn() with the device synchronised around each call."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(fn, iters: int) -> float:
    """Median device time of one CUDA-graph replay of fn."""
    if DEVICE != "cuda":
        fn()
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up on a side stream before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


class TreeOps:
    """Inputs of one DDTree step: drafter log-probs, target tokens, paged caches."""

    def __init__(self, batch: int, budget: int, args):
        dev = DEVICE
        self.batch, self.budget, self.depth = batch, budget, args.max_depth
        self.topk_cap = args.topk_cap
        n = budget + 1
        gen = torch.Generator(device=dev).manual_seed(batch * 1000 + budget)
        logits = 2.0 * torch.randn(batch, self.depth, args.vocab, device=dev, generator=gen)
        self.logprobs = logits.log_softmax(dim=-1)
        self.roots = torch.randint(0, args.vocab, (batch,), device=dev, generator=gen)
        # Target tokens that follow the tree 80% of the time, so walks go deep.
        tree = self.build()
        child_tok = torch.zeros(batch, n + 1, dtype=torch.int64, device=dev)
        is_child = tree.valid & (torch.arange(n, device=dev) > 0)  # the root is no child
        child_tok.scatter_(1, torch.where(is_child, tree.parents, n), tree.tokens)
        noise = torch.randint(0, args.vocab, (batch, n), device=dev, generator=gen)
        keep = torch.rand(batch, n, device=dev, generator=gen) < 0.8
        self.target = torch.where(keep, child_tok[:, :n], noise)
        # Paged caches of every layer in vLLM's CUDA layout (K and V in one row per
        # head and slot); verify rows sit at positions context .. context + n - 1.
        page = args.page_size
        pages = -(-(args.context + n) // page)
        num_blocks = batch * pages
        self.caches = [
            torch.randn(num_blocks, KV_HEADS, page, 2 * HEAD_DIM, device=dev, dtype=torch.bfloat16)
            for _ in range(args.layers)
        ]
        # The rows the drafter reads: target hidden states (DFlash conditions on
        # several layers; five here) and token ids; positions of the verify rows.
        self.rows = [torch.randn(batch * n, HIDDEN, device=dev, dtype=torch.bfloat16)
                     for _ in range(5)]
        self.rows.append(torch.zeros(batch * n, dtype=torch.int32, device=dev))
        self.positions = (args.context + torch.arange(n, device=dev)).repeat(batch)
        self.num_scheduled = torch.full((batch,), budget, device=dev)
        table = torch.randperm(num_blocks, device=dev).view(batch, pages)
        pos = args.context + torch.arange(n, device=dev)
        self.slot_mapping = (table[:, pos // page] * page + pos % page).flatten()
        self.query_start_loc = torch.arange(0, batch * n + 1, n, device=dev, dtype=torch.int32)
        self.row_start = self.query_start_loc[:-1].to(torch.int64)

    def build(self):
        return build_ddtree(self.logprobs, self.roots, self.budget, self.topk_cap)

    @property
    def k(self) -> int:
        """Tokens per depth the build keeps: min(budget, cap, vocab)."""
        return topk_width(self.budget, self.topk_cap, self.logprobs.shape[-1])

    def walk(self, tree):
        return walk_tree(tree, self.target, self.depth)

    def compact(self, walk) -> None:
        # As the model runner does on CUDA (runner.compact_after_walk): one launch for
        # the KV of every layer, the state rows, the token ids and the positions.
        # (The row starts come from the step's positions kernel there, on the device.)
        compact_step_triton(self.caches, self.slot_mapping, self.rows[:-1], self.rows[-1],
                            self.positions, walk.accepted_nodes, self.row_start,
                            self.num_scheduled, self.budget + 1)

    def step(self) -> None:
        tree = self.build()
        self.compact(self.walk(tree))


class Qwen3Step:
    """Qwen3-8B-shaped forward over `tokens` tokens: GEMMs + tree attention, 36 layers."""

    def __init__(self, batch: int, queries: int, args):
        from vllm_ddtree.kernels.tree_attention import tree_attention_triton
        from vllm_ddtree.tensors import pack_tree_mask

        self.attend = tree_attention_triton
        dev, dt = DEVICE, torch.bfloat16
        self.layers, self.tokens = args.layers, batch * queries
        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM

        def w(k, m):
            return torch.randn(k, m, device=dev, dtype=dt) * k**-0.5

        # Two weight sets used alternately, so no layer finds its weights in L2.
        self.weights = [
            (w(HIDDEN, qkv), w(HEADS * HEAD_DIM, HIDDEN), w(HIDDEN, 2 * INTER), w(INTER, HIDDEN))
            for _ in range(2)
        ]
        self.lm_head = w(HIDDEN, args.vocab)
        self.x = torch.randn(self.tokens, HIDDEN, device=dev, dtype=dt)
        page = args.page_size
        seq = args.context + queries
        pages = -(-seq // page)
        shape = (batch * pages, page, KV_HEADS, HEAD_DIM)
        self.key_cache = torch.randn(shape, device=dev, dtype=dt)
        self.value_cache = torch.randn(shape, device=dev, dtype=dt)
        self.block_table = torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
        self.seq_lens = torch.full((batch,), seq, device=dev, dtype=torch.int32)
        self.query_start_loc = torch.arange(0, self.tokens + 1, queries, device=dev, dtype=torch.int32)
        causal = torch.ones(queries, queries, dtype=torch.bool, device=dev).tril()
        self.mask = pack_tree_mask(causal[None].expand(batch, -1, -1).contiguous())
        self.queries, self.seq = queries, seq

    def __call__(self) -> torch.Tensor:
        x = self.x
        for layer in range(self.layers):
            w_qkv, w_o, w_gu, w_down = self.weights[layer % 2]
            qkv = x @ w_qkv
            q = qkv[:, : HEADS * HEAD_DIM].view(self.tokens, HEADS, HEAD_DIM)
            attn = self.attend(
                q, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
                self.query_start_loc, self.mask, HEAD_DIM**-0.5,
                max_query_len=self.queries, max_seq_len=self.seq,
            )
            x = x + attn.view(self.tokens, -1) @ w_o
            gate_up = x @ w_gu
            x = x + (torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]) @ w_down
        return x @ self.lm_head


def main(argv: list[str] | None = None) -> None:
    global DEVICE
    args = parse_args(argv)
    if args.cpu_dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_tree_ops needs a CUDA GPU (or --cpu-dry-run)")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"device {name}  torch {torch.__version__}  "
          f"depth {args.max_depth}  vocab {args.vocab}  layers {args.layers}  context {args.context}")
    rows = []
    for batch in args.batches:
        decode_ms = graph_ms(Qwen3Step(batch, 1, args), 5)
        torch.cuda.empty_cache()
        for budget in args.budgets:
            row = measure_ops(batch, budget, args)
            row["verify_step_ms"] = graph_ms(Qwen3Step(batch, budget + 1, args), 5)
            row["decode_step_ms"] = decode_ms
            torch.cuda.empty_cache()
            row["eager_pct"] = 100 * row["ops_eager_ms"] / row["verify_step_ms"]
            row["graph_pct"] = 100 * row["ops_graph_ms"] / row["verify_step_ms"]
            rows.append(row)
            print(format_row(row), flush=True)
            save(args, name, rows)
    print("\n== DDTree tree ops per step vs a Qwen3-8B-shaped verify step, H200 ==")
    print(HEADER)
    for row in rows:
        print(format_row(row))
    print("\n== top-k per depth, one graph replay (ms): as built vs torch.topk + tie repair ==")
    print(f"{'batch':>5} {'B':>4} {'k':>4} {'as built':>9} {'topk+repair':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['budget']:>4} {r['k']:>4} {r['topk_graph_ms']:>9.3f} "
              f"{r['topk_repair_graph_ms']:>12.3f} "
              f"{r['topk_graph_ms'] / r['topk_repair_graph_ms']:>6.2f}")
    print(f"wrote {args.out}")


def measure_ops(batch: int, budget: int, args) -> dict:
    """Eager breakdown, eager total and graph replay of one DDTree step's tree ops."""
    ops = TreeOps(batch, budget, args)
    tree = ops.build()
    walk = ops.walk(tree)
    row = {"batch": batch, "budget": budget, "queries": batch * (budget + 1)}
    row["build_eager_ms"] = wall_ms(ops.build, args.iters)
    row["walk_eager_ms"] = wall_ms(functools.partial(ops.walk, tree), args.iters)
    row["compact_eager_ms"] = wall_ms(functools.partial(ops.compact, walk), args.iters)
    row["ops_eager_ms"] = wall_ms(ops.step, args.iters)
    row["ops_graph_ms"] = graph_ms(ops.step, args.iters)
    row["build_graph_ms"] = graph_ms(ops.build, args.iters)
    row["walk_graph_ms"] = graph_ms(functools.partial(ops.walk, tree), args.iters)
    row["compact_graph_ms"] = graph_ms(functools.partial(ops.compact, walk), args.iters)
    row["mean_accepted"] = float(walk.num_accepted.float().mean())
    # The build's top-k as dispatched (fused up to FUSED_TOPK_MAX_K) next to torch.topk
    # with the tie repair, at the same k, in the same run.
    row["k"] = ops.k
    row["topk_graph_ms"] = graph_ms(lambda: topk_per_depth(ops.logprobs, ops.k), args.iters)
    row["topk_repair_graph_ms"] = graph_ms(
        lambda: _topk_and_repair(ops.logprobs, ops.k, use_triton=True), args.iters)
    return row


def save(args, device_name: str, rows: list[dict]) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({
            "device": device_name, "torch": torch.__version__,
            "max_depth": args.max_depth, "vocab": args.vocab, "layers": args.layers,
            "context": args.context, "page_size": args.page_size,
            "note": "ops = build_ddtree + walk_tree + compaction as the runner does it on "
                    "CUDA (KV of every layer, hidden/aux/token-id rows and positions in "
                    "one launch); step = Qwen3-8B-shaped GEMMs + tree attention, CUDA graph",
            "results": rows,
        }, f, indent=1)

HEADER = (
    f"{'':>10} {'---------- eager ms ----------':>30} {'---------- graph ms ----------':>30}"
    f" {'- step ms (graph) -':>19} {'ops/verify %':>13}\n"
    f"{'batch':>5} {'B':>4} {'build':>7} {'walk':>6} {'compact':>7} {'total':>7} "
    f"{'build':>7} {'walk':>6} {'compact':>7} {'total':>7} {'verify':>9} {'decode':>9} "
    f"{'eager':>6} {'graph':>6}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['batch']:>5} {r['budget']:>4} {r['build_eager_ms']:>7.3f} {r['walk_eager_ms']:>6.3f} "
        f"{r['compact_eager_ms']:>7.3f} {r['ops_eager_ms']:>7.3f} {r['build_graph_ms']:>7.3f} "
        f"{r['walk_graph_ms']:>6.3f} {r['compact_graph_ms']:>7.3f} {r['ops_graph_ms']:>7.3f} "
        f"{r['verify_step_ms']:>9.3f} {r['decode_step_ms']:>9.3f} {r['eager_pct']:>6.1f} "
        f"{r['graph_pct']:>6.1f}"
    )


if __name__ == "__main__":
    main()
