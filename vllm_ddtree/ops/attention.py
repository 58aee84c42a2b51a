"""Tree attention in torch, batched over requests: the CPU backend's verify rows.

Same signature and semantics as ``tree_attention_reference`` (attention_reference.py: cache
layout, verify rows, masks), which stays the readable oracle and loops over requests.
This version pads the requests of a chunk to the chunk's longest sequence and its
widest tree and attends them all in one pair of batched matmuls, so a verify step
costs a few large tensor ops per layer instead of a few small ones per request.

Padded key positions (past a request's ``seq_len``) read whatever block the table
holds there; their K and V are zeroed and their scores masked, so neither garbage nor
NaN reaches a row. Requests are taken in chunks whose score tensor stays under
``max_scores`` elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.tensors import unpack_tree_mask

__all__ = ["TorchTreePlan", "plan_tree_attention_torch", "run_tree_attention_torch",
           "tree_attention_torch"]

MAX_SCORES = 1 << 24  # float32 scores per chunk: 64 MiB


@dataclass
class _Chunk:
    """Index tensors of a chunk of requests, padded to ``c`` requests x ``W`` verify
    rows x ``L`` key positions; the same for every layer of a step."""

    rows: torch.Tensor  # [c, W] int64 query row of each (request, verify slot), 0 if none
    row_ok: torch.Tensor  # [c, W] bool, the slot is one of the request's rows
    blocks: torch.Tensor  # [c, L] int64 cache block of each key position
    offsets: torch.Tensor  # [c, L] int64 offset in that block
    key_ok: torch.Tensor  # [c, L, 1, 1] bool, position < seq_len
    hidden: torch.Tensor  # [c, 1, 1, W, L] bool, the row does not see the key


@dataclass
class TorchTreePlan:
    """What :func:`run_tree_attention_torch` needs besides a layer's tensors: made
    once per step, as the step's layers differ only in query, caches and output."""

    chunks: list[_Chunk]
    num_heads: int


def tree_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    scale: float,
    max_scores: int = MAX_SCORES,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``tree_attention_reference`` batched over requests (float32 softmax; rows past
    ``query_start_loc[-1]`` come back as zeros). Inputs are trusted: the reference
    checks them."""
    plan = plan_tree_attention_torch(block_table, seq_lens, query_start_loc, tree_mask,
                                     query.shape[1], key_cache.shape[1], max_scores)
    return run_tree_attention_torch(plan, query, key_cache, value_cache, scale)


def plan_tree_attention_torch(
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    num_heads: int,
    block_size: int,  # the KV cache's
    max_scores: int = MAX_SCORES,
) -> TorchTreePlan:
    """Chunks of requests and their padded row, key and visibility indices."""
    if tree_mask is not None and tree_mask.dtype == torch.int32:
        tree_mask = unpack_tree_mask(tree_mask)
    num_reqs = seq_lens.shape[0]
    query_lens = query_start_loc.diff().long()
    chunks: list[_Chunk] = []
    if num_reqs == 0:
        return TorchTreePlan(chunks, num_heads)
    width = max(1, int(query_lens.max()))
    longest = max(1, int(seq_lens.max()))
    step = max(1, max_scores // (num_heads * width * longest))
    for first in range(0, num_reqs, step):
        reqs = slice(first, min(num_reqs, first + step))
        chunks.append(_plan_chunk(
            block_table[reqs], seq_lens[reqs].long(), query_start_loc[reqs].long(),
            query_lens[reqs], None if tree_mask is None else tree_mask[reqs], width,
            block_size,
        ))
    return TorchTreePlan(chunks, num_heads)


def _plan_chunk(
    block_table: torch.Tensor,  # [c, max_blocks]
    seq_lens: torch.Tensor,  # [c] int64
    starts: torch.Tensor,  # [c] int64, first query row of each request
    query_lens: torch.Tensor,  # [c] int64
    tree_mask: torch.Tensor | None,  # [c, >= width, >= width] bool
    width: int,
    block_size: int,
) -> _Chunk:
    device = seq_lens.device
    num_reqs = seq_lens.shape[0]
    length = max(1, int(seq_lens.max()))
    positions = torch.arange(length, device=device)
    key_ok = positions[None, :] < seq_lens[:, None]  # [c, L]
    slot = torch.arange(width, device=device)
    row_ok = slot[None, :] < query_lens[:, None]  # [c, W]
    # Keys each row sees: the whole prefix, then its tree (or causal) part.
    node = positions[None, :] - (seq_lens - query_lens)[:, None]  # [c, L] tree index
    in_tree = (node >= 0) & key_ok
    if tree_mask is None:
        tree_part = node[:, None, :] <= slot[None, :, None]
    else:
        index = node.clamp(0, tree_mask.shape[2] - 1)[:, None, :].expand(-1, width, -1)
        tree_part = torch.gather(tree_mask[:, :width], 2, index)
    visible = (node < 0)[:, None, :] | (in_tree[:, None, :] & tree_part)  # [c, W, L]
    visible = visible | ~row_ok[:, :, None]  # padding rows: anything finite, not written
    return _Chunk(
        rows=torch.where(row_ok, starts[:, None] + slot[None, :], 0),
        row_ok=row_ok,
        blocks=block_table[:, positions // block_size].long(),
        offsets=(positions % block_size).expand(num_reqs, length),
        key_ok=key_ok[:, :, None, None],
        hidden=~visible[:, None, None],
    )


def run_tree_attention_torch(
    plan: TorchTreePlan,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """One layer's verify rows under a step's plan."""
    output = torch.zeros_like(query)
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    for chunk in plan.chunks:
        num_reqs, width = chunk.rows.shape
        # K/V, zero past each request's seq_len: [c, L, kvh, d]
        key = torch.where(chunk.key_ok, key_cache[chunk.blocks, chunk.offsets].float(), 0.0)
        value = torch.where(chunk.key_ok, value_cache[chunk.blocks, chunk.offsets].float(),
                            0.0)
        q = query[chunk.rows].float().view(num_reqs, width, num_kv_heads, group, head_dim)
        scores = torch.einsum("cwkgd,clkd->ckgwl", q, key) * scale
        probs = torch.softmax(scores.masked_fill(chunk.hidden, float("-inf")), dim=-1)
        out = torch.einsum("ckgwl,clkd->cwkgd", probs, value)
        out = out.reshape(num_reqs, width, num_heads, head_dim)
        output[chunk.rows[chunk.row_ok]] = out[chunk.row_ok].to(output.dtype)
    return output
