"""A training run's resumable state, saved as a directory of small files.

``state/state.json`` holds the step, the data position (epoch, cursor), the counters
and the log so far; ``state/tensors-*.safetensors`` hold the drafter's float32
weights, the AdamW moments and the RNG states, in shards of at most about
``shard_bytes`` (the lent GPU's call returns files of at most 16 MiB each). A
directory is written beside its final path and swapped in whole, so a run killed
while saving leaves the previous state intact.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

STATE_FORMAT = 1


@contextlib.contextmanager
def replace_dir(path: Path) -> Iterator[Path]:
    """Yield an empty sibling directory to write into; on success it replaces ``path``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def shard_tensors(directory: Path, stem: str, tensors: dict[str, torch.Tensor],
                  shard_bytes: int) -> list[Path]:
    """Save ``tensors`` as ``{stem}-00000.safetensors``, ... of at most about
    ``shard_bytes`` each (a tensor larger than that is cut along its first dim)."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        pieces = _pieces(t, shard_bytes)
        for k, piece in enumerate(pieces):
            nbytes = piece.numel() * piece.element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name if len(pieces) == 1 else f"{name}@{k}/{len(pieces)}"] = piece
            size += nbytes
    paths = []
    for n, shard in enumerate(shards):
        paths.append(directory / f"{stem}-{n:05d}.safetensors")
        save_file(shard, str(paths[-1]), metadata={"format": "pt"})
    return paths


def _pieces(t: torch.Tensor, shard_bytes: int) -> list[torch.Tensor]:
    nbytes = t.numel() * t.element_size()
    if nbytes <= shard_bytes or t.dim() == 0 or t.shape[0] < 2:
        return [t]
    rows = max(1, t.shape[0] * shard_bytes // nbytes)
    return [p.contiguous() for p in t.split(rows)]


def load_shards(directory: Path, stem: str) -> dict[str, torch.Tensor]:
    """The tensors ``shard_tensors`` saved, pieces joined again."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob(f"{stem}-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {stem}-*.safetensors in {directory}")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in raw.items():
        if "@" in name:
            base, frac = name.rsplit("@", 1)
            pieces.setdefault(base, {})[int(frac.split("/")[0])] = t
        else:
            out[name] = t
    for base, parts in pieces.items():
        out[base] = torch.cat([parts[k] for k in sorted(parts)])
    return out


@dataclass
class Progress:
    """Everything of a run that changes with each step, besides tensors."""

    step: int = 0
    epoch: int = 0  # passes over the training sequences started
    cursor: int = 0  # next position in this epoch's shuffled order
    tokens_seen: int = 0  # sequence tokens the training batches covered
    blocks_seen: int = 0  # training blocks (anchors) drafted
    train_s: float = 0.0  # training seconds over all calls
    curve: list[dict] = field(default_factory=list)  # one row per progress line
    calls: list[dict] = field(default_factory=list)  # one row per call (process)


def save_state(directory: Path, progress: Progress, model: torch.nn.Module,
               opt: torch.optim.Optimizer, sampler: torch.Generator, *, shard_bytes: int,
               moments_dtype: torch.dtype = torch.float32) -> None:
    """Write the resumable state to ``directory`` (replacing it)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().float() for n, p in model.named_parameters()}
    steps = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            n = names[id(p)]
            tensors[f"adam.exp_avg.{n}"] = st["exp_avg"].to(moments_dtype)
            tensors[f"adam.exp_avg_sq.{n}"] = st["exp_avg_sq"].to(moments_dtype)
            steps[n] = float(st["step"])
    tensors["rng.sampler"] = sampler.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    meta = {"format": STATE_FORMAT, "progress": asdict(progress), "adam_steps": steps,
            "python_random": _jsonable(random.getstate())}
    with replace_dir(directory) as tmp:
        (tmp / "state.json").write_text(json.dumps(meta) + "\n")
        shard_tensors(tmp, "tensors", tensors, shard_bytes)


def load_state(directory: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
               sampler: torch.Generator) -> Progress:
    """Restore what ``save_state`` wrote into ``model``, ``opt`` and ``sampler``, and
    the global RNGs; returns the progress counters."""
    meta = json.loads((Path(directory) / "state.json").read_text())
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{directory}/state.json: format {meta.get('format')}, expected "
                         f"{STATE_FORMAT}")
    t = load_shards(directory, "tensors")
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(t[f"model.{n}"])
    for group in opt.param_groups:
        for p in group["params"]:
            n = names[id(p)]
            if n not in meta["adam_steps"]:
                continue
            opt.state[p] = {
                "step": torch.tensor(meta["adam_steps"][n], dtype=torch.float32),
                "exp_avg": t[f"adam.exp_avg.{n}"].to(p.device, torch.float32),
                "exp_avg_sq": t[f"adam.exp_avg_sq.{n}"].to(p.device, torch.float32),
            }
    sampler.set_state(t["rng.sampler"])
    torch.set_rng_state(t["rng.torch"])
    if "rng.cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["rng.cuda"])
    random.setstate(_tupled(meta["python_random"]))
    return Progress(**meta["progress"])


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
