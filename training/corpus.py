"""Prompt files and the held-out split.

A prompt file is one of:

- a JSON list of strings, or of objects ``{"prompt": ..., "group": ...}``;
- JSON Lines (``.jsonl``): one such string or object per line;
- plain text: one prompt per non-empty line.

``group`` names where a prompt came from (a template, a source document). The
held-out split takes whole groups, so no held-out prompt shares its text or its
template with a training prompt. A prompt without a group is its own group.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    text: str  # the user message (the chat template is applied later)
    group: str  # prompts of one group fall on the same side of the split


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of ``path`` in file order, duplicates dropped (first one kept)."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    elif path.suffix == ".json" or raw.lstrip().startswith("["):
        items = json.loads(raw)
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a JSON list of prompts, got {type(items).__name__}")
    else:
        items = [line for line in raw.splitlines() if line.strip()]
    prompts: dict[str, Prompt] = {}
    for n, item in enumerate(items):
        prompt = _to_prompt(item, f"{path} item {n}")
        prompts.setdefault(prompt.text, prompt)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return list(prompts.values())


def _to_prompt(item: object, where: str) -> Prompt:
    if isinstance(item, str):
        text, group = item, None
    elif isinstance(item, dict):
        text = item.get("prompt", item.get("text"))
        group = item.get("group", item.get("template"))
    else:
        text, group = None, None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: expected a non-empty string or an object with a "
                         f"'prompt' string, got {item!r:.80}")
    return Prompt(text, str(group) if group is not None else "text:" + text)


def split_heldout(groups: list[str], frac: float, seed: int) -> set[str]:
    """The held-out groups: each group is held out when a hash of (seed, group) falls
    below ``frac``, so the split does not depend on the file's order. At least one
    group lands on each side."""
    distinct = sorted(set(groups))
    if len(distinct) < 2:
        raise ValueError(f"all {len(groups)} prompts are in one group ({distinct}): a "
                         "held-out split needs prompts of at least two groups")
    if not 0.0 < frac < 1.0:
        raise ValueError(f"heldout_frac={frac}: need a fraction in (0, 1)")
    score = {g: _unit_hash(seed, g) for g in distinct}
    held = {g for g in distinct if score[g] < frac}
    if not held:
        held = {min(distinct, key=score.__getitem__)}
    if len(held) == len(distinct):
        held.discard(max(distinct, key=score.__getitem__))
    return held


def _unit_hash(seed: int, group: str) -> float:
    digest = hashlib.sha256(f"{seed}\0{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def run_heldout_prompts(run_dir: str | Path) -> list[str]:
    """The prompts a ``python -m training`` run held out (its data and settings)."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "data" / "data.json").read_text())
    settings = json.loads((run_dir / "training_log.json").read_text())["settings"]
    held = split_heldout(meta["groups"], settings["heldout_frac"], settings["seed"])
    return [t for t, g in zip(meta["prompts"], meta["groups"]) if g in held]
