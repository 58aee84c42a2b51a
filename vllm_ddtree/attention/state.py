"""The tree of the verify step being built, handed to attention metadata builders.

vLLM builds attention metadata from a ``CommonAttentionMetadata`` that knows
nothing of trees. The model runner publishes the step's tree here for exactly
the duration of the target's metadata build (:func:`publishing`); builders of
the DDTree backends attach it to their metadata. The drafter builds its own
metadata later, when nothing is published, so it never sees a tree.

Under full CUDA graphs (a uniform batch of ``budget + 1`` query rows per
request, vLLM's "uniform decode") the tree kernel is captured once and
replayed every step, reading the ancestor masks from one persistent buffer
(:func:`mask_buffer`), so each step's masks are written into that buffer.
The graph is captured with a causal tree (:func:`causal_attention_info`: the
capture's dummy batch has none), and only steps whose every row is a tree
row replay it (runner.v1.may_replay_full_graph).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from vllm_ddtree.sync import to_device
from vllm_ddtree.tensors import pack_tree_mask, packed_view


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
    # Every request's query rows are this many tree rows (0: not so): FLASH_ATTN's
    # builder then takes each prefix length as seq_len less this, in one launch.
    uniform_query_len: int = 0
    # Made once per step by prepare_for on the metadata's device (or given, packed
    # already), shared by all layers.
    packed_mask: torch.Tensor | None = None  # [num_reqs, width, ceil(width / 32)] int32
    rows: torch.Tensor | None = None  # [num_tree_rows] int64, flat query rows of the trees
    req_index: torch.Tensor | None = None  # [num_tree_reqs] int64, = tree_reqs
    rows_query_start_loc: torch.Tensor | None = None  # [num_tree_reqs + 1] int32, over rows
    # Tree-attention launch plans of this step by tensor signature and metadata
    # (attention/cuda.py): made by a group's first layer, reused by the others.
    attention_plans: dict = field(default_factory=dict)
    # Persistent [max_num_reqs, budget + 1, words] int32 (mask_buffer) that prepare_for
    # packs into, so a tree kernel captured in a CUDA graph reads this step's masks.
    mask_buffer: torch.Tensor | None = None
    prepared: bool = False  # prepare_for has run

    @property
    def skips_parent_attention(self) -> bool:
        """The step runs only tree attention: some request has a tree and every
        query row is a tree row, so the CUDA backends skip the parent's kernel."""
        return bool(self.tree_reqs) and self.all_rows_are_tree_rows

    @property
    def num_reqs(self) -> int:
        return self.num_rows.shape[0]

    @property
    def width(self) -> int:
        """Verify rows of the widest tree: budget + 1 when every draft was sent."""
        return self.tree_mask.shape[1]

    def prepare_for(self, device: torch.device) -> None:
        """Pack the masks unless they came packed (into ``mask_buffer`` when given)
        and, for steps in which some rows are not tree rows (or on the CPU, whose
        backend always takes that path), index the tree rows on ``device``; once
        per step."""
        if self.prepared:
            return
        if self.packed_mask is None:
            mask = self.tree_mask
            if mask.device.type != device.type:
                mask = to_device(mask, device)
            packed = pack_tree_mask(mask)
            if self.mask_buffer is not None:
                view = packed_view(self.mask_buffer, packed.shape[0], packed.shape[1])
                packed = view.copy_(packed)
            self.packed_mask = packed
        if not self.all_rows_are_tree_rows or device.type != "cuda":
            self._index_tree_rows(device)
        self.prepared = True

    def _index_tree_rows(self, device: torch.device) -> None:
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


def causal_attention_info(
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32 on the host
    width: int,  # verify width, budget + 1
    buffer: torch.Tensor | None = None,
) -> TreeAttentionInfo:
    """Every request's rows as a causal chain (a tree that is a path): tree attention
    then equals causal attention. Published for vLLM's capture of a full CUDA graph
    of verify shape, whose dummy batch carries no tree, so that the graph holds the
    tree kernel."""
    starts = query_start_loc.to(torch.int64)
    query_lens = starts.diff()
    num_reqs = query_lens.shape[0]
    if num_reqs and int(query_lens.max()) > width:
        raise ValueError(
            f"a causal tree covers at most {width} rows per request, got "
            f"{int(query_lens.max())}"
        )
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return TreeAttentionInfo(
        tree_mask=causal.expand(num_reqs, width, width).contiguous(),
        row_start=starts[:-1],
        num_rows=query_lens,
        tree_reqs=torch.nonzero(query_lens > 0).flatten().tolist(),
        all_rows_are_tree_rows=True,
        mask_buffer=buffer,
    )


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
