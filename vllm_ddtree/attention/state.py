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
from dataclasses import dataclass, field

import torch

from vllm_ddtree.attention.reference import pack_tree_mask
from vllm_ddtree.sync import to_device


@dataclass
class TreeAttentionInfo:
    """Which query rows are tree rows, and their ancestor masks."""

    tree_mask: torch.Tensor  # [num_reqs, width, width] bool; [r, i, j] = j ancestor-or-self of i
    row_start: torch.Tensor  # [num_reqs] int64 on the host, flat query row of each root
    num_rows: torch.Tensor  # [num_reqs] int64 on the host, tree rows per request (0 = none)
    tree_reqs: list[int]  # requests that carry a tree (host-side)
    # Every query row of the batch belongs to a tree (a decode request without
    # drafts is a root-only tree): CUDA backends then skip their own kernel.
    all_rows_are_tree_rows: bool = False
    # Made once per step by prepare_for on the metadata's device, shared by all layers.
    packed_mask: torch.Tensor | None = None  # [num_reqs, width, ceil(width / 32)] int32
    rows: torch.Tensor | None = None  # [num_tree_rows] int64, flat query rows of the trees
    req_index: torch.Tensor | None = None  # [num_tree_reqs] int64, = tree_reqs
    rows_query_start_loc: torch.Tensor | None = None  # [num_tree_reqs + 1] int32, over rows
    # Tree-attention launch plans of this step by tensor signature and metadata
    # (attention/cuda.py): made by a group's first layer, reused by the others.
    attention_plans: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return self.num_rows.shape[0]

    @property
    def width(self) -> int:
        """Verify rows of the widest tree: budget + 1 when every draft was sent."""
        return self.tree_mask.shape[1]

    def prepare_for(self, device: torch.device) -> None:
        """Pack the masks and index the tree rows on ``device``, once per step."""
        if self.packed_mask is not None:
            return
        self.packed_mask = pack_tree_mask(self.tree_mask.to(device))
        reqs = torch.tensor(self.tree_reqs, dtype=torch.int64)
        counts = self.num_rows[reqs]
        offsets = torch.arange(int(counts.max()))
        rows = self.row_start[reqs, None] + offsets[None, :]
        rows = rows[offsets[None, :] < counts[:, None]]
        query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        query_start_loc[1:] = counts.cumsum(0)
        self.rows = to_device(rows, device)
        self.req_index = to_device(reqs, device)
        self.rows_query_start_loc = to_device(query_start_loc, device)


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
