"""Kimi K2.6's step cost at its full depth, from two cut depths that bench_gpu_step.py ran.

One H200 holds Kimi's text model at full width only when cut to its first (dense) layer
and one or two MoE layers (`bench_gpu_step.py --shape kimi-k2.6 --moe-layers N`). The
drafter's cost and the host's work do not grow with the target's depth, so ratios to
plain decoding read from a cut model overstate what the 61-layer model pays. Two runs
at different MoE depths give each configuration's cost per MoE layer; this script
adds that cost for the MoE layers the cut left out (Kimi K2.6: 61 layers, the first
dense, so 60 MoE layers):

    full = deep + (60 - deep_moe_layers) * (deep - shallow) / (deep_moe_layers - shallow_moe_layers)

for each method, budget and batch both runs measured, and the ratios to plain decoding
and to the chain at full depth. Both runs must come from the same kind of GPU. It is an extrapolation, not a measurement: it assumes a
MoE layer costs the same at any depth (dummy weights route alike in every layer), and
the cut drafter reads every target layer (its input projection grows with the cut's
depth, a small part of the per-layer cost).

    python benchmarks/kimi_depth.py SHALLOW.json DEEP.json --out benchmarks/results/kimi_depth_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KIMI_MOE_LAYERS = 60  # 61 layers, first_k_dense_replace 1


def depth_of(report: dict) -> int:
    """MoE layers of a bench_gpu_step Kimi run."""
    if "kimi-k2.6" not in str(report["arguments"]["shape"]):
        raise ValueError("not a --shape kimi-k2.6 run of bench_gpu_step.py")
    return int(report["arguments"]["moe_layers"])


def step_costs(report: dict) -> dict[tuple[str, int | None, int], float]:
    """ms per step of every (method, budget, batch) in a report (runs without errors)."""
    return {(run["method"], run["budget"], row["batch"]): row["ms_per_step"]
            for run in report["runs"] if not run.get("error") for row in run["rows"]}


def extrapolate(shallow: dict, deep: dict, moe_layers: int = KIMI_MOE_LAYERS) -> list[dict]:
    """One row per (method, budget, batch) both reports measured: the two cut costs,
    the cost per MoE layer, the full-depth cost, and its ratios to plain decoding and
    to the chain at the same batch (None where that run is missing)."""
    lo, hi = depth_of(shallow), depth_of(deep)
    if hi <= lo:
        raise ValueError(f"the deep run must have more MoE layers than the shallow one "
                         f"(got {hi} and {lo})")
    if hi > moe_layers:
        raise ValueError(f"the deep run has {hi} MoE layers, more than the model's {moe_layers}")
    cards = [str(r["environment"].get("gpu") or "?").split(",")[0] for r in (shallow, deep)]
    if cards[0] != cards[1]:
        raise ValueError(f"the two runs ran on different GPUs ({cards[0]}, {cards[1]}): "
                         "their costs do not combine")
    a, b = step_costs(shallow), step_costs(deep)
    rows = []
    for key in sorted(a.keys() & b.keys(), key=lambda k: (k[0], k[1] or 0, k[2])):
        per_layer = (b[key] - a[key]) / (hi - lo)
        rows.append({"method": key[0], "budget": key[1], "batch": key[2],
                     "ms_shallow": a[key], "ms_deep": b[key], "ms_per_moe_layer": per_layer,
                     "ms_full": b[key] + (moe_layers - hi) * per_layer})
    full = {(r["method"], r["budget"], r["batch"]): r["ms_full"] for r in rows}
    for r in rows:
        for name, base in (("x_plain", ("plain", None, r["batch"])),
                           ("x_chain", ("chain", None, r["batch"]))):
            r[name] = r["ms_full"] / full[base] if base in full else None
    return rows


def table(rows: list[dict], lo: int, hi: int, moe_layers: int) -> str:
    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    header = (f"| method | budget | batch | ms, {lo} MoE | ms, {hi} MoE | ms per MoE layer | "
              f"ms, {moe_layers} MoE (extrapolated) | x plain | x chain |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['budget'] or '-'} | {r['batch']} | {r['ms_shallow']:.2f} | "
              f"{r['ms_deep']:.2f} | {r['ms_per_moe_layer']:.3f} | {r['ms_full']:.1f} | "
              f"{ratio(r['x_plain'])} | {ratio(r['x_chain'])} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shallow", type=Path, help="bench_gpu_step.py JSON, fewer MoE layers")
    p.add_argument("deep", type=Path, help="bench_gpu_step.py JSON, more MoE layers")
    p.add_argument("--moe-layers", type=int, default=KIMI_MOE_LAYERS,
                   help=f"the full model's MoE layers (Kimi K2.6: {KIMI_MOE_LAYERS})")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    shallow, deep = (json.loads(path.read_text()) for path in (args.shallow, args.deep))
    try:
        rows = extrapolate(shallow, deep, args.moe_layers)
    except ValueError as e:
        p.error(str(e))
    lo, hi = depth_of(shallow), depth_of(deep)
    print(table(rows, lo, hi, args.moe_layers))
    report = {"shallow": str(args.shallow), "deep": str(args.deep), "shallow_moe_layers": lo,
              "deep_moe_layers": hi, "moe_layers": args.moe_layers,
              "gpu": deep["environment"].get("gpu"), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
