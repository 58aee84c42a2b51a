"""Summary of bench_serving.py results: every timed pass pooled into medians with 90%
intervals, ratios paired round by round, serving latencies, a table and a plot.

A results file holds ``rounds`` (one row per timed pass: mode, method, set, temperature,
load, round, tokens, seconds, tok_per_s; serve rows also TTFT and TPOT per request and
tau) and ``tau`` (offline: one counted pass per engine and key). Several files pool: the
bootstrap draws files first, then rounds within each (bench_e2e.bootstrap_median).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import bench_e2e

REFERENCES = ("plain", "chain", "best_chain")  # the ratios every row carries
LOAD_NAME = {"offline": "batch", "serve": "concurrency"}


def is_chain(method: str) -> bool:
    return method == "chain" or method.startswith("chain-")


def reference(round_rates: dict[str, float], ref: str) -> float | None:
    """tokens/s of plain decoding, of the fixed chain, or of the fastest chain method in
    one round (the bar DDTree has to clear under load, whatever the chain's schedule)."""
    if ref == "best_chain":
        chains = [v for m, v in round_rates.items() if is_chain(m)]
        return max(chains) if chains else None
    return round_rates.get(ref)


def median_interval(runs: list[list[float]]) -> dict:
    every = [x for run in runs for x in run]
    low, high = bench_e2e.bootstrap_median(runs)
    return {"median": statistics.median(every), "interval_90": [low, high],
            "range": [min(every), max(every)]}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the two nearest ranks."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (mode, method, set, temperature, load) over every run's rounds."""
    rates: dict[tuple, dict[tuple, dict[str, float]]] = {}  # load key -> (run, round) -> method
    groups: dict[tuple, dict[int, list[dict]]] = {}
    taus: dict[tuple, list[float]] = {}
    order: dict[str, int] = {}
    for i, data in enumerate(runs):
        for r in data.get("rounds", []):
            load_key = (r["mode"], r["set"], r["temperature"], r["load"])
            rates.setdefault(load_key, {}).setdefault((i, r["round"]), {})[r["method"]] = (
                r["tok_per_s"])
            groups.setdefault((r["mode"], r["method"], *load_key[1:]), {}).setdefault(
                i, []).append(r)
            order.setdefault(r["method"], len(order))
            if r.get("tau") is not None:
                taus.setdefault((r["mode"], r["method"], *load_key[1:]), []).append(r["tau"])
        for t in data.get("tau", []):
            key = (t["mode"], t["method"], t["set"], t["temperature"], t["load"])
            taus.setdefault(key, []).append(t["tau"])
    rows = []
    for key, per_run in groups.items():
        mode, method, name, temperature, load = key
        row = {"mode": mode, "method": method, "set": name, "temperature": temperature,
               "load": load, "runs": len(per_run),
               "rounds": sum(len(v) for v in per_run.values()),
               "tok_per_s": median_interval([[r["tok_per_s"] for r in v]
                                             for v in per_run.values()]),
               "tau": statistics.median(taus[key]) if key in taus else None}
        for ref in REFERENCES:
            ratios = [[r["tok_per_s"] / base for r in v if (base := reference(
                rates[(mode, name, temperature, load)][(i, r["round"])], ref))]
                for i, v in per_run.items()]
            ratios = [x for x in ratios if x]
            row["vs_" + ref] = median_interval(ratios) if ratios else None
        if mode == "serve":
            row.update(latencies([r for v in per_run.values() for r in v]))
        rows.append(row)
    rows.sort(key=lambda r: (r["mode"] != "offline", r["set"], r["temperature"], r["load"],
                             order[r["method"]]))
    return rows


def latencies(passes: list[dict]) -> dict:
    """TTFT and TPOT percentiles in ms over every request of every pass, and errors."""
    ttft = [x for p in passes for x in p.get("ttft_s", [])]
    tpot = [x for p in passes for x in p.get("tpot_s", [])]
    def ms(values: list[float], q: float) -> float | None:
        x = percentile(values, q)
        return None if x is None else round(1000 * x, 3)

    return {"ttft_ms": {"p50": ms(ttft, 50), "p99": ms(ttft, 99)},
            "tpot_ms": {"p50": ms(tpot, 50), "p99": ms(tpot, 99)},
            "requests": sum(p.get("requests", 0) for p in passes),
            "errors": sum(len(p.get("errors", [])) for p in passes)}


def ratio_text(value: dict | None) -> str:
    if value is None:
        return "-"
    low, high = value["interval_90"]
    return f"{value['median']:.2f}x ({low:.2f}-{high:.2f})"


def table(rows: list[dict]) -> str:
    """The summary as text: one block per mode."""
    lines = []
    for mode in ("offline", "serve"):
        block = [r for r in rows if r["mode"] == mode]
        if not block:
            continue
        head = (f"{'set':<10}{'T':>4}{LOAD_NAME[mode]:>12}  {'method':<20}{'tau':>6}"
                f"{'tok/s':>9}  {'90%':<13}{'÷ plain':<20}{'÷ chain':<20}{'÷ best chain':<20}")
        if mode == "serve":
            head += f"{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}"
        lines += [f"[{mode}]", head]
        for r in block:
            tok = r["tok_per_s"]
            line = (f"{r['set']:<10}{r['temperature']:>4.1f}{r['load']:>12}  {r['method']:<20}"
                    + (f"{r['tau']:>6.2f}" if r["tau"] is not None else f"{'-':>6}")
                    + f"{tok['median']:>9.1f}  {interval_text(tok['interval_90']):<13}"
                    + "".join(f"{ratio_text(r['vs_' + ref]):<20}" for ref in REFERENCES))
            if mode == "serve":
                t, p = r["ttft_ms"], r["tpot_ms"]
                line += f"{fmt(t['p50'])}/{fmt(t['p99']):<8}".rjust(18)
                line += f"{fmt(p['p50'])}/{fmt(p['p99']):<8}".rjust(18)
                line += f"  {r['errors']} errors" if r["errors"] else ""
            lines.append(line)
    return "\n".join(lines)


def interval_text(bounds: list[float]) -> str:
    digits = 0 if min(bounds) >= 100 else 1 if min(bounds) >= 1 else 3
    return f"{bounds[0]:.{digits}f}-{bounds[1]:.{digits}f}"


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(rows: list[dict], path: Path) -> bool:
    """tokens/s (median, 90% interval as bars) against batch size or concurrency: one
    panel per mode and prompt set, one line per method. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = sorted({(r["mode"], r["set"], r["temperature"]) for r in rows},
                    key=lambda p: (p[0] != "offline", p[1], p[2]))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (mode, name, temperature) in zip(axes[0], panels):
        mine = [r for r in rows if (r["mode"], r["set"], r["temperature"]) == (mode, name,
                                                                                temperature)]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted((r["load"], r["tok_per_s"]) for r in mine if r["method"] == method)
            mid = [t["median"] for _, t in pts]
            err = [[m - t["interval_90"][0] for m, (_, t) in zip(mid, pts)],
                   [t["interval_90"][1] - m for m, (_, t) in zip(mid, pts)]]
            ax.errorbar([x for x, _ in pts], mid, yerr=err, marker="o", capsize=3, label=method)
        ax.set_xscale("log", base=2)
        loads = sorted({r["load"] for r in mine})
        ax.set_xticks(loads, [str(x) for x in loads])
        ax.set_xlabel(LOAD_NAME[mode])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{mode}, {name}, T={temperature:g}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def report(runs: list[dict]) -> list[dict]:
    """Summarize runs and print the table."""
    rows = summarize(runs)
    print(table(rows))
    if not all(d.get("engines_together", True) for d in runs):
        print("[serving] engines ran one at a time: a round's ratios pair passes by round "
              "number, not passes taken side by side")
    return rows


def draw(rows: list[dict], stem: Path) -> str:
    """STEM.png where matplotlib is; the words for the closing message."""
    return f" and {stem}.png" if plot(rows, Path(f"{stem}.png")) else (
        " (install matplotlib for the plot)")


def pool_files(paths: list[Path], stem: Path) -> dict:
    """Pool earlier runs' files: the table, STEM.json (the rows) and STEM.png."""
    runs = [json.loads(p.read_text()) for p in paths]
    for path, data in zip(paths, runs):
        if "rounds" not in data:
            raise SystemExit(f"{path} is not a bench_serving.py results file (no 'rounds')")
    rows = report(runs)
    stem.parent.mkdir(parents=True, exist_ok=True)
    out = {"files": [str(p) for p in paths],
           "engines_together": [d.get("engines_together") for d in runs], "rows": rows}
    Path(f"{stem}.json").write_text(json.dumps(out, indent=1))
    print(f"[serving] wrote {stem}.json{draw(rows, stem)}")
    return out
