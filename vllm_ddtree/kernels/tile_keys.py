"""The tree keys each query tile of the tree kernel sees, listed once per step.

A verify row sees only its ancestors, so the rows of one query tile (a run of
consecutive verify tokens) share few tree keys, scattered over the tree. The
tree kernel (tree_attention.py) walks each tile's keys in chunks of ``BLOCK_N``
taken from this list instead of the tree's own key tiles: at budget 256 with
16-token tiles a tile's rows see about 22 keys spread over 3-4 of the tree's 17
key tiles (the random trees of bench_tree_attention.py), which fit one or two
chunks. The list depends on the masks and the tiling alone, so a step's layers
(and KV heads) share one made by the plan (tree_attention_plan.py).

For request ``r`` and query tile ``t`` (verify tokens ``t * tokens_per_tile`` up
to the next tile's first): ``counts[r, t]`` keys ``j < num_queries[r]`` have bit
``j`` set in some row of the tile, listed in increasing order in
``keys[r, t, :counts[r, t]]``; the kernel reads nothing past the count (zeros
when made, stale ones after a CUDA graph's later replays).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.tensors import BITS_PER_WORD

__all__ = ["list_tile_keys", "list_tile_keys_reference", "tile_keys_width"]


def tile_keys_width(mask_width: int) -> int:
    """Length of a tile's key row: the mask's words (a power of two) x 32 bits."""
    return triton.next_power_of_2(-(-mask_width // BITS_PER_WORD)) * BITS_PER_WORD


def list_tile_keys(
    packed_mask: torch.Tensor,  # [num_reqs, width, words] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tokens_per_tile: int,
    num_q_tiles: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # keys [num_reqs, num_q_tiles, K] int16, counts
    """One launch, no host synchronisation (capturable); see the module docstring."""
    num_reqs, width, num_words = packed_mask.shape
    if packed_mask.dtype != torch.int32 or query_start_loc.shape[0] < num_reqs + 1:
        raise ValueError(
            f"packed_mask must be int32 [num_reqs, width, words] and query_start_loc "
            f"[num_reqs + 1], got {packed_mask.dtype} {tuple(packed_mask.shape)} and "
            f"{tuple(query_start_loc.shape)}"
        )
    if tokens_per_tile < 1 or num_q_tiles < 1:
        raise ValueError(
            f"tokens_per_tile and num_q_tiles must be >= 1, got {tokens_per_tile} and "
            f"{num_q_tiles}"
        )
    key_width = tile_keys_width(width)
    device = packed_mask.device
    keys = torch.zeros(num_reqs, num_q_tiles, key_width, dtype=torch.int16, device=device)
    counts = torch.zeros(num_reqs, num_q_tiles, dtype=torch.int32, device=device)
    if num_reqs == 0:
        return keys, counts
    list_tile_keys_kernel[(num_q_tiles, num_reqs)](
        keys, counts, packed_mask, query_start_loc,
        packed_mask.stride(0), packed_mask.stride(1), num_words,
        TOKENS_PER_TILE=tokens_per_tile,
        TOKENS_PAD=triton.next_power_of_2(tokens_per_tile),
        MASK_WORDS=key_width // BITS_PER_WORD,
        num_warps=4,
    )
    return keys, counts


def list_tile_keys_reference(
    packed_mask: torch.Tensor,  # [num_reqs, width, words] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tokens_per_tile: int,
    num_q_tiles: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # keys [num_reqs, num_q_tiles, K] int16, counts
    """Torch twin of :func:`list_tile_keys`: the same lists, zeros past each count."""
    num_reqs, width, _ = packed_mask.shape
    key_width = tile_keys_width(width)
    keys = torch.zeros(num_reqs, num_q_tiles, key_width, dtype=torch.int16)
    counts = torch.zeros(num_reqs, num_q_tiles, dtype=torch.int32)
    bit = torch.arange(BITS_PER_WORD)
    words = packed_mask.cpu()
    # bits[r, i, j]: bit j of row i's mask (j over whole words).
    bits = ((words[..., None] >> bit) & 1).flatten(2) != 0
    num_queries = query_start_loc.cpu().diff()[:num_reqs]
    for r in range(num_reqs):
        n = int(num_queries[r])
        for t in range(num_q_tiles):
            rows = bits[r, t * tokens_per_tile : min(n, (t + 1) * tokens_per_tile), :n]
            seen = rows.any(0).nonzero().flatten() if rows.numel() else bit[:0]
            counts[r, t] = seen.numel()
            keys[r, t, : seen.numel()] = seen.to(torch.int16)
    return keys.to(packed_mask.device), counts.to(packed_mask.device)


@triton.jit(do_not_specialize=["mask_stride_r", "mask_stride_q", "num_words"])
def list_tile_keys_kernel(
    keys_ptr,  # [num_reqs, num_q_tiles, MASK_WORDS * 32] int16
    counts_ptr,  # [num_reqs, num_q_tiles] int32
    mask_ptr,  # [num_reqs, width, num_words] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    mask_stride_r,
    mask_stride_q,
    num_words,
    TOKENS_PER_TILE: tl.constexpr,
    TOKENS_PAD: tl.constexpr,  # TOKENS_PER_TILE, next power of two
    MASK_WORDS: tl.constexpr,  # num_words, next power of two
):
    tile = tl.program_id(0)
    req = tl.program_id(1)
    tile_row = req * tl.num_programs(0) + tile
    num_queries = tl.load(query_start_loc_ptr + req + 1) - tl.load(query_start_loc_ptr + req)
    offs = tl.arange(0, TOKENS_PAD)
    token = tile * TOKENS_PER_TILE + offs
    token_ok = (offs < TOKENS_PER_TILE) & (token < num_queries)
    word = tl.arange(0, MASK_WORDS)
    word_ok = (word < num_words) & (word < tl.cdiv(num_queries, 32))
    words = tl.load(
        mask_ptr + req.to(tl.int64) * mask_stride_r + token[:, None] * mask_stride_q
        + word[None, :],
        mask=token_ok[:, None] & word_ok[None, :],
        other=0,
    )
    seen_words = tl.reduce(words, 0, _bit_or)  # [MASK_WORDS]: the tile's rows' OR
    bit = tl.arange(0, 32)
    seen = tl.reshape((seen_words[:, None] >> bit[None, :]) & 1, [MASK_WORDS * 32])
    key = tl.arange(0, MASK_WORDS * 32)
    seen = tl.where(key < num_queries, seen, 0)  # a padded mask's bits past the tree
    rank = tl.cumsum(seen, 0) - 1  # place of each seen key in the list
    tl.store(
        keys_ptr + tile_row.to(tl.int64) * (MASK_WORDS * 32) + rank,
        key.to(tl.int16),
        mask=seen != 0,
    )
    tl.store(counts_ptr + tile_row, tl.sum(seen, 0))


@triton.jit
def _bit_or(a, b):
    return a | b
