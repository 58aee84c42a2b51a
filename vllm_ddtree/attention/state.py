"""The tree of the verify step being built, handed to attention metadata builders.

vLLM builds attention metadata from a ``CommonAttentionMetadata`` that knows
nothing of trees. The model runner publishes the step's tree here for exactly
the duration of the target's metadata build (:func:`publishing`); builders of
the DDTree backends attach it to their metadata. The drafter builds its own
metadata later, when nothing is published, so it never sees a tree.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class TreeAttentionInfo:
    """Which query rows are tree rows, and their ancestor masks."""

    tree_mask: torch.Tensor  # [num_reqs, width, width] bool; [r, i, j] = j ancestor-or-self of i
    row_start: torch.Tensor  # [num_reqs] int64, flat query row of each root
    num_rows: torch.Tensor  # [num_reqs] int64, tree rows per request (0 = not a tree row)
    tree_reqs: list[int]  # requests that carry a tree (host-side, for the CPU path)


_current: TreeAttentionInfo | None = None


@contextmanager
def publishing(info: TreeAttentionInfo | None) -> Iterator[None]:
    """Publish ``info`` to attention metadata builders inside the block."""
    global _current
    previous, _current = _current, info
    try:
        yield
    finally:
        _current = previous


def current_tree() -> TreeAttentionInfo | None:
    """The tree of the verify step whose metadata is being built, if any."""
    return _current
