"""MLA tree attention (Triton) against the backend's causal decode for the same rows.

For every (context, batch, budget): each request has a prefix of ``context`` tokens and
budget + 1 verify rows, absorbed MLA over one latent cache (Kimi K2 / DeepSeek-V3
widths by default: 64 heads, latent 512 + rope 64, bf16, paged). Timed as CUDA-graph
replays (median ms):

- tree:   vllm_ddtree.kernels.mla_tree_attention, random trees (depth <= 15) in the
          plugin's preorder layout, split over the SMs as TRITON_MLA's DDTree engine
          runs it (``--max-len`` sizes the splits, as the model's length does there);
- decode: what TRITON_MLA runs for a chain of the same rows, vLLM's
          ``decode_attention_fwd`` with per-row causal extents (``--no-decode`` skips it,
          and it is skipped where vLLM's Triton kernels are not importable).

``--variants 16x2,32x8`` also times the tree kernel at other tilings (keys per tile x
programs per SM that split-KV aims at; the kernel's default is 16x2), each with its own
ratio and median, to choose the default from.

``--check`` also compares the tree kernel with its torch twin
(ops/mla_attention.mla_tree_attention) on every case, largest absolute difference in
the table. Prints a table and writes JSON (``--out``). The issue's bar: tree <= 1.2x
decode, median over contexts 1K-32K.

    python benchmarks/bench_mla_attention.py --check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_tree_attention import bench, int_list, random_tree_mask

from vllm_ddtree.kernels.mla_tree_attention import (
    BLOCK_N,
    WAVES,
    check_tiling,
    mla_tree_attention_triton,
)
from vllm_ddtree.ops.mla_attention import mla_tree_attention
from vllm_ddtree.tensors import pack_tree_mask


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int_list, default=[1024, 4096, 16384, 32768])
    p.add_argument("--batches", type=int_list, default=[1, 8])
    p.add_argument("--budgets", type=int_list, default=[16, 64, 256, 512])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--rank", type=int, default=512, help="kv_lora_rank")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-depth", type=int, default=15)
    p.add_argument("--max-len", type=int, default=32768 + 1024,
                   help="the model length the tree kernel sizes its KV splits by")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--check", action="store_true", help="compare with the torch twin")
    p.add_argument("--no-decode", action="store_true", help="skip vLLM's decode kernel")
    p.add_argument("--variants", type=variant_list, default=[],
                   help="further tilings to time, BLOCK_NxWAVES, e.g. 32x2,16x8")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/mla_attention.json")
    return p.parse_args(argv)


def variant_list(text: str) -> list[tuple[int, int]]:
    """``"16x2,32x8"`` -> [(16, 2), (32, 8)]: keys per tile x programs per SM, each
    checked as the kernel checks its tiling."""
    try:
        pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
        if not pairs or any(len(p) != 2 for p in pairs):
            raise ValueError("no BLOCK_NxWAVES items")
        for block_n, waves in pairs:
            check_tiling(block_n, waves)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected BLOCK_NxWAVES items, e.g. 32x2,16x8 ({exc})") from exc
    return pairs


def variant_name(block_n: int, waves: int) -> str:
    return f"{block_n}x{waves}"


def load_decode():
    """vLLM's Triton MLA decode kernel (TRITON_MLA's forward_mqa), or None."""
    try:
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    except Exception as exc:  # noqa: BLE001 (any import failure: time without it)
        print(f"  (vLLM's decode_attention_fwd unavailable: {type(exc).__name__}: {exc})")
        return None
    return decode_attention_fwd


def decode_splits(seq_len: int) -> int:
    """TRITON_MLA's KV-split count for this length (its own rule where importable)."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits
    except Exception:  # noqa: BLE001
        return 16
    return _compute_num_kv_splits(seq_len, current_platform.num_compute_units())


class Case:
    """A paged latent cache for ``batch`` requests of ``context + n`` tokens each."""

    def __init__(self, args, context: int, batch: int, n: int, seed: int) -> None:
        dev, dtype = "cuda", getattr(torch, args.dtype)
        gen = torch.Generator(device=dev).manual_seed(seed)
        page, width = args.page_size, args.rank + args.rope
        seq = context + n
        pages = -(-seq // page)
        self.kv_cache = torch.randn(batch * pages, page, width, device=dev, dtype=dtype,
                                    generator=gen)
        self.block_table = torch.randperm(batch * pages, device=dev, generator=gen,
                                          dtype=torch.int32).view(batch, pages)
        self.seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=dev)
        self.q_nope = torch.randn(batch * n, args.heads, args.rank, device=dev, dtype=dtype,
                                  generator=gen) * 0.1
        self.q_pe = torch.randn(batch * n, args.heads, args.rope, device=dev, dtype=dtype,
                                generator=gen) * 0.1
        mask = random_tree_mask(n, args.max_depth, seed).to(dev)
        self.mask = mask[None].expand(batch, n, n).contiguous()
        self.packed = pack_tree_mask(self.mask)
        self.scale = (128 + args.rope) ** -0.5  # nope 128 + rope, as Kimi K2 and DSV3
        self.n, self.batch = n, batch

    def tree(self, max_len: int, **tiling):
        return mla_tree_attention_triton(
            self.q_nope, self.q_pe, self.kv_cache, self.block_table, self.seq_lens,
            self.qsl, self.packed, self.scale, max_seq_len=max_len, **tiling)[0]

    def decode_call(self, decode, args):
        """TRITON_MLA's call for a causal chain of the same rows: one row per query,
        its extent up to itself."""
        n, rows = self.n, self.batch * self.n
        block_table = self.block_table.repeat_interleave(n, dim=0)
        offsets = torch.arange(1 - n, 1, device="cuda", dtype=torch.int32)
        seq_lens = (self.seq_lens[:, None] + offsets).flatten()
        q = torch.cat([self.q_nope, self.q_pe], dim=-1)
        out = torch.empty(rows, args.heads, args.rank, device="cuda", dtype=q.dtype)
        lse = torch.empty(rows, args.heads, device="cuda", dtype=q.dtype)
        splits = decode_splits(int(self.seq_lens[0]))
        logits = torch.empty(rows, args.heads, splits, args.rank + 1, device="cuda",
                             dtype=torch.float32)
        cache = self.kv_cache.unsqueeze(2)
        one = torch.ones((), device="cuda")

        def call():
            decode(q, cache, cache[..., : args.rank], out, lse, block_table, seq_lens,
                   logits, splits, self.scale, args.page_size, k_scale=one, v_scale=one,
                   is_mla=True)

        return call


def run(args) -> list[dict]:
    decode = None if args.no_decode else load_decode()
    rows = []
    print(f"{'context':>7} {'batch':>5} {'budget':>6} {'tree ms':>8} {'decode ms':>9} "
          f"{'ratio':>6} {'max |diff|':>10}")
    for context in args.contexts:
        for batch in args.batches:
            for budget in args.budgets:
                case = Case(args, context, batch, budget + 1, seed=budget)
                row = {"context": context, "batch": batch, "budget": budget,
                       "tree_ms": bench(lambda c=case: c.tree(args.max_len), args.rep_ms)}
                for block_n, waves in args.variants:
                    row.setdefault("variants", {})[variant_name(block_n, waves)] = bench(
                        lambda c=case, b=block_n, w=waves: c.tree(args.max_len, block_n=b,
                                                                  waves=w), args.rep_ms)
                if decode is not None:
                    row["decode_ms"] = bench(case.decode_call(decode, args), args.rep_ms)
                    row["ratio"] = row["tree_ms"] / row["decode_ms"]
                    row["variant_ratios"] = {name: ms / row["decode_ms"]
                                             for name, ms in row.get("variants", {}).items()}
                if args.check:
                    want, _ = mla_tree_attention(case.q_nope, case.q_pe, case.kv_cache,
                                                 case.block_table, case.seq_lens, case.qsl,
                                                 case.mask, case.scale)
                    row["max_abs_diff"] = float(
                        (case.tree(args.max_len).float() - want.float()).abs().max())
                rows.append(row)
                print(f"{context:>7} {batch:>5} {budget:>6} {row['tree_ms']:>8.3f} "
                      f"{row.get('decode_ms', float('nan')):>9.3f} "
                      f"{row.get('ratio', float('nan')):>6.2f} "
                      f"{row.get('max_abs_diff', float('nan')):>10.2e}"
                      + "".join(f"  {name} {ratio:.2f}"
                                for name, ratio in row.get("variant_ratios", {}).items()),
                      flush=True)
                save(args, rows)  # partial results survive a timeout
                del case
                torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> dict:
    """Median tree / decode ratio over the measured cases, overall and per budget; the
    same for each further tiling (``variants``)."""
    result = medians(rows, lambda r: r.get("ratio"))
    names = sorted({name for r in rows for name in r.get("variant_ratios", {})})
    if result and names:
        result["variants"] = {
            name: medians(rows, lambda r, n=name: r.get("variant_ratios", {}).get(n))
            for name in names}
    return result


def medians(rows: list[dict], ratio) -> dict:
    """The median of ``ratio(row)`` over the rows that have one, overall and per budget."""
    values = [(r["budget"], v) for r in rows if (v := ratio(r)) is not None]
    if not values:
        return {}
    return {"median_ratio": statistics.median(v for _, v in values),
            "median_ratio_by_budget": {
                str(budget): statistics.median(v for b, v in values if b == budget)
                for budget in sorted({b for b, _ in values})}}


def save(args, rows: list[dict]) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "heads": args.heads, "rank": args.rank, "rope": args.rope,
        "page_size": args.page_size, "dtype": args.dtype, "max_len": args.max_len,
        "default_tiling": variant_name(BLOCK_N, WAVES),
        "timing": "median CUDA-graph replay (ms)", "results": rows,
        "summary": summary(rows),
    }, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla_attention needs a CUDA GPU")
    started = time.time()
    print(f"device {torch.cuda.get_device_name()}  heads {args.heads}  latent "
          f"{args.rank}+{args.rope}  {args.dtype}  page {args.page_size}")
    rows = run(args)
    print(f"summary ({time.time() - started:.0f} s): {summary(rows)}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
