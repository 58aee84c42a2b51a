"""The trees a verify step checks, and their rows' positions (torch twins).

Each request verifies the tree its drafter built when the drafts the scheduler sent are
that tree's tokens (or a prefix of them), and otherwise the chain it was sent as
(:func:`step_trees`: :func:`chain_trees`, then :func:`select_trees`). The tree's rows
then move to their depth positions (:func:`tree_positions`): siblings share a position,
while each node's KV slot stays that of its row. On CUDA one launch does both
(``kernels/step_trees.py``); these are its twins, the CPU path and the test oracle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_ddtree.sync import to_device
from vllm_ddtree.tensors import DDTree, TreeVerifyStep

if TYPE_CHECKING:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata


def chain_step(metadata: SpecDecodeMetadata, device: torch.device) -> TreeVerifyStep:
    """A verify step in which every request's drafts form a plain chain."""
    num_scheduled = to_device(torch.tensor(metadata.num_draft_tokens), device)
    width = metadata.max_spec_len + 1
    cu_sampled = metadata.cu_num_sampled_tokens.to(torch.int64)
    return TreeVerifyStep(
        tree=chain_trees(metadata, num_scheduled, width),
        num_scheduled=num_scheduled,
        row_start=cu_sampled - num_scheduled - 1,
        max_depth=max(width - 1, 1),
    )


def step_trees(
    drafted: DDTree | None,  # the drafter's last trees, [num_prev_reqs, budget + 1] per field
    index: torch.Tensor | None,  # [num_reqs] int64, row in `drafted` (-1: none); with drafted
    metadata: SpecDecodeMetadata,
    num_scheduled: torch.Tensor,  # [num_reqs] int64
    width: int,
    *,
    packed_out: torch.Tensor | None = None,  # [>= num_reqs, >= width, >= words] int32
    use_triton: bool | None = None,  # None: the Triton kernel on CUDA, else torch
) -> DDTree:
    """The tree each request verifies: its drafted tree where the scheduled drafts
    match it (select_trees), else the chain it was sent as (chain_trees). With
    ``packed_out``, the ancestor masks are also packed into its leading
    ``[num_reqs, width, ceil(width / 32)]`` corner (tensors.pack_tree_mask)."""
    if use_triton is None:
        use_triton = num_scheduled.is_cuda
    if use_triton:
        from vllm_ddtree.kernels.step_trees import step_trees_triton

        return step_trees_triton(drafted, index, metadata.draft_token_ids,
                                 metadata.cu_num_draft_tokens, num_scheduled, width,
                                 packed_out)
    tree = chain_trees(metadata, num_scheduled, width)
    if drafted is not None and index is not None:
        tree = select_trees(drafted, index, tree, num_scheduled)
    if packed_out is not None:
        from vllm_ddtree.tensors import pack_tree_mask, packed_view

        packed_view(packed_out, *tree.tokens.shape).copy_(pack_tree_mask(tree.ancestor_mask))
    return tree


def chain_trees(
    metadata: SpecDecodeMetadata,
    num_scheduled: torch.Tensor,  # [num_reqs] int64
    width: int,
) -> DDTree:
    """Each request's scheduled drafts as a chain: node i's parent is i - 1."""
    device = num_scheduled.device
    num_reqs = num_scheduled.shape[0]
    node = torch.arange(width, device=device)
    present = node[None, :] <= num_scheduled[:, None]  # [num_reqs, width]
    drafts = metadata.draft_token_ids.to(torch.int64)
    tokens = torch.zeros(num_reqs, width, dtype=torch.int64, device=device)
    if drafts.numel() > 0:
        first = metadata.cu_num_draft_tokens.to(torch.int64) - num_scheduled
        index = (first[:, None] + node[None, :] - 1).clamp(0, drafts.numel() - 1)
        tokens = torch.where(present & (node[None, :] > 0), drafts[index], 0)
    parents = (node - 1).clamp(min=0).expand(num_reqs, width)
    depths = torch.where(present, node[None, :], 0)
    causal = node[None, :] <= node[:, None]  # [width, width]: j <= i
    eye = torch.eye(width, dtype=torch.bool, device=device)
    mask = torch.where(present[:, :, None], causal & present[:, None, :], eye)
    return DDTree(
        tokens=tokens,
        parents=parents.contiguous(),
        depths=depths,
        valid=present,
        ancestor_mask=mask,
        num_nodes=num_scheduled.clone(),
    )


def select_trees(
    drafted: DDTree,  # [num_prev_reqs, budget + 1] per field
    index: torch.Tensor | list[int],  # [num_reqs] row of each request in `drafted`, -1 if none
    chains: DDTree,  # [num_reqs, width] the scheduled drafts as chains
    num_scheduled: torch.Tensor,  # [num_reqs]
) -> DDTree:
    """Each request's drafted tree where its scheduled drafts match it, else its chain.

    The scheduler may send a prefix of the node list (still a tree, since
    parents precede children); a request whose drafts differ from its tree in
    any other way is verified as the chain it was sent as.
    """
    device = chains.tokens.device
    width = chains.tokens.shape[1]
    rows = torch.as_tensor(index, dtype=torch.int64, device=device)
    known = rows >= 0
    picked = _take(drafted, rows.clamp(min=0), width)
    node = torch.arange(width, device=device)
    present = node[None, :] <= num_scheduled[:, None]
    same = ((picked.tokens == chains.tokens) | ~present | (node[None, :] == 0)).all(1)
    use = known & same
    valid = picked.valid & present

    def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(use.view(-1, *([1] * (a.dim() - 1))), a, b)

    # Ancestors precede their nodes, so a scheduled node's ancestors are all
    # scheduled; padding nodes keep {root, self} and never influence real ones.
    mask = picked.ancestor_mask
    return DDTree(
        tokens=pick(picked.tokens, chains.tokens),
        parents=pick(picked.parents, chains.parents),
        depths=pick(picked.depths, chains.depths),
        valid=pick(valid, chains.valid),
        ancestor_mask=pick(mask, chains.ancestor_mask),
        num_nodes=pick(valid[:, 1:].sum(1), chains.num_nodes),
    )


def _take(tree: DDTree, rows: torch.Tensor, width: int) -> DDTree:
    """Rows of a tree batch, cut (or padded with invalid nodes) to ``width``."""
    budget1 = tree.tokens.shape[1]
    if width > budget1:
        raise ValueError(
            f"{width - 1} drafts were scheduled but trees have budget {budget1 - 1}."
        )
    return DDTree(
        tokens=tree.tokens[rows, :width],
        parents=tree.parents[rows, :width],
        depths=tree.depths[rows, :width],
        valid=tree.valid[rows, :width],
        ancestor_mask=tree.ancestor_mask[rows, :width, :width],
        num_nodes=tree.num_nodes[rows],
    )


def tree_positions(
    positions: torch.Tensor,  # [num_rows] vLLM's positions of the step: root + i at row start + i
    query_start_loc: torch.Tensor,  # [num_reqs + 1] the step's query offsets
    num_scheduled: torch.Tensor,  # [num_reqs] int64, tree nodes sent per request
    depths: torch.Tensor,  # [num_reqs, width] int64, depth of each node
) -> torch.Tensor:  # [num_reqs] int64, flat row of each root
    """Siblings share a position: node i of a request moves to root + depth_i, in place
    (its KV slot stays that of row start + i). Returns each request's root row; a
    request's tree rows end its query rows. On CUDA the step-trees launch does this
    (kernels.step_trees.step_trees_triton with positions), this is its torch twin."""
    num_reqs, width = depths.shape
    row_start = query_start_loc[1 : num_reqs + 1].to(torch.int64) - num_scheduled - 1
    node = torch.arange(width, device=depths.device)
    present = node[None, :] <= num_scheduled[:, None]
    # Absent nodes add 0 to their request's root row (a scatter-add, so the repeats
    # are harmless); no boolean indexing, so the host never waits.
    rows = torch.where(present, row_start[:, None] + node[None, :], row_start[:, None])
    delta = torch.where(present, depths - node, 0).to(positions.dtype)
    positions.index_add_(0, rows.flatten(), delta.flatten())
    return row_start
