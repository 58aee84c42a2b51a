"""bench_gpu_step.py's report: ratios, the markdown tables, the run's environment (versions,
GPU, the plugin's code digest) and the results file."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def engine_ops_ms(row: dict) -> float | None:
    """The tree ops as the engine runs them on CUDA: the build replays a CUDA graph
    (vllm_ddtree/tree_graph.py), the walk and the compaction launch eagerly."""
    parts = [row.get(k) for k in ("build_graph_ms", "walk_eager_ms", "compact_eager_ms")]
    return None if any(p is None for p in parts) else sum(parts)


def add_shares(ops_rows: list[dict], records: list[dict]) -> None:
    """Tree-ops time as a percentage of the DDTree step measured in vLLM: all in one
    graph, all eager, and as the engine runs them."""
    steps = {(r["budget"], row["batch"]): row["ms_per_step"] for r in records
             if r["method"] == "ddtree" for row in r["rows"] if "ms_per_step" in row}
    for row in ops_rows:
        step = steps.get((row["budget"], row["batch"]))
        row["ddtree_step_ms"] = step
        row["ops_engine_ms"] = engine_ops_ms(row)
        for mode in ("graph", "eager", "engine"):
            ops = row.get(f"ops_{mode}_ms")
            ok = step is not None and ops is not None and not math.isnan(step) and step > 0
            row[f"share_{mode}_pct"] = 100 * ops / step if ok else None


def add_ratios(records: list[dict]) -> None:
    """Each row's step time over the plain and the chain step, same runner and batch."""
    ref = {(r["runner"], r["method"], row["batch"]): row["ms_per_step"] for r in records
           for row in r["rows"] if "ms_per_step" in row}
    for r in records:
        for row in r["rows"]:
            for base in ("plain", "chain"):
                other = ref.get((r["runner"], base, row["batch"]))
                mine = row.get("ms_per_step")
                row[f"x_{base}"] = mine / other if mine and other else None


def fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def step_table(records: list[dict]) -> str:
    lines = ["| runner | method | budget | batch | ms/step | tokens/step | ms/token "
             "| x plain step | x chain step | note |", "|" + "---|" * 10]
    for r in records:
        head = f"| {r['runner']} | {r['method']} | {r['budget'] or '-'} "
        if r["error"]:
            lines.append(head + "| - " * 6 + f"| {short_error(r['error'])} |")
        for row in r["rows"]:
            lines.append(head + f"| {row['batch']} | {fmt(row.get('ms_per_step'), '.3f')} "
                         f"| {fmt(row.get('tokens_per_step'), '.2f')} "
                         f"| {fmt(row.get('ms_per_token'), '.3f')} "
                         f"| {fmt(row.get('x_plain'), '.2f')} | {fmt(row.get('x_chain'), '.2f')} "
                         f"| {short_error(row.get('error')) or row.get('suspect', '')} |")
    return "\n".join(lines)


def share_table(ops_rows: list[dict]) -> str:
    lines = ["| batch | budget | DDTree ms/step | ops ms (as run) | share "
             "| ops ms (graph) | share | ops ms (eager) "
             "| share | build | walk | compact (graph ms) | note |", "|" + "---|" * 13]
    for row in ops_rows:
        g, e = row.get("share_graph_pct"), row.get("share_eager_pct")
        r = row.get("share_engine_pct")
        lines.append(
            f"| {row['batch']} | {row['budget']} | {fmt(row.get('ddtree_step_ms'), '.3f')} "
            f"| {fmt(row.get('ops_engine_ms'), '.3f')} | {fmt(r, '.1f')}{' %' if r else ''} "
            f"| {fmt(row.get('ops_graph_ms'), '.3f')} | {fmt(g, '.1f')}{' %' if g else ''} "
            f"| {fmt(row.get('ops_eager_ms'), '.3f')} | {fmt(e, '.1f')}{' %' if e else ''} "
            f"| {fmt(row.get('build_graph_ms'), '.3f')} | {fmt(row.get('walk_graph_ms'), '.3f')} "
            f"| {fmt(row.get('compact_graph_ms'), '.3f')} | {short_error(row.get('error'))} |")
    return "\n".join(lines)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def short_error(error: str | None) -> str:
    return "" if not error else error.splitlines()[0][:80].replace("|", "/")


def gpu_query(fields: str) -> str | None:
    command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20,
                             check=True).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def plugin_digest(package: Path) -> str:
    """sha256 (16 hex digits) over the package's Python sources, by relative path."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def environment(dry_run: bool) -> dict[str, Any]:
    from importlib import metadata

    env: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(), "gpu": gpu_query("name,driver_version"),
        "dry_run": dry_run,
    }
    for key, dist in (("torch", "torch"), ("vllm", "vllm"), ("vllm_ddtree", "vllm-ddtree"),
                      ("triton", "triton")):
        try:
            env[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[key] = None
    if "vllm" in sys.modules:  # the module that actually ran, whatever pip metadata says
        env["vllm"] = sys.modules["vllm"].__version__
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch_cuda"] = torch.version.cuda
        if env["gpu"] is None and torch.cuda.is_initialized():
            env["gpu"] = torch.cuda.get_device_name()
    try:
        env["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["git"] = None
    # The plugin the engines import (the first on the path), by content: a copy of the
    # working tree may carry a stale .git (the lent GPU's did), so "git" alone can
    # name the wrong code. Compare with plugin_digest() of a checkout.
    spec = importlib.util.find_spec("vllm_ddtree")
    env["plugin_digest"] = (plugin_digest(Path(spec.origin).parent)
                            if spec is not None and spec.origin else None)
    env["env"] = {k: v for k, v in os.environ.items()
                  if k.startswith(("VLLM_USE_FLASHINFER", "VLLM_ATTENTION", "CUDA_VISIBLE"))}
    return env


def save(path: Path, args: argparse.Namespace, records: list[dict], ops_rows: list[dict],
         env: dict[str, Any]) -> None:
    """Rewritten after every engine, so a run cut short keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path.write_text(json.dumps(no_nan({
        "environment": env, "arguments": arguments,
        "note": "ms per decode step = (long - short wall time) / (long - short steps); "
                "dummy weights, so acceptance is near zero and these are step costs",
        "runs": records, "tree_ops": ops_rows,
        "table_markdown": step_table(records), "share_markdown": share_table(ops_rows),
    }), indent=1, default=str) + "\n")


def no_nan(value: Any) -> Any:
    """NaN (no steps, no histogram) as null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [no_nan(v) for v in value]
    return value
