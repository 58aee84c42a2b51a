"""Tree attention in plain torch over vLLM's paged KV cache.

This is the torch twin of the tree-attention kernel: the test oracle for the Triton
kernel and for the CPU backend's batched version (ops/attention.py). It loops over
requests for clarity, not speed.

KV-cache layout. ``key_cache`` and ``value_cache`` are (views of) shape
``[num_blocks, block_size, num_kv_heads, head_dim]``: the layout FlashAttention-style
backends in vLLM attend over. vLLM allocates one ``kv_cache`` tensor per layer,
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, and splits it as
``kv_cache.transpose(1, 2).split(head_dim, dim=-1)``; those strided views are accepted
as they are. Token ``p`` of request ``r`` lives in block
``block_table[r, p // block_size]`` at offset ``p % block_size``; its slot is
``block_id * block_size + offset``.

Verify rows. Request ``r`` owns the ``n_r`` queries from ``query_start_loc[r]`` to
``query_start_loc[r + 1] - 1`` (budget + 1 for a DDTree request, 1 for a plain decode
row). Their K/V are already in the cache at positions ``start .. start + n_r - 1`` with
``start = seq_lens[r] - n_r``. Verify query ``i`` attends to the whole prefix
(positions ``< start``) and to verify token ``j`` iff ``tree_mask[r, i, j]`` (``j`` is
an ancestor of ``i`` or ``i`` itself), or iff ``j <= i`` when ``tree_mask`` is None
(plain causal rows).

Packed mask. Column ``j`` of a mask row is bit ``j % 32`` (least significant bit
first) of int32 word ``j // 32``; bit 31 is the sign bit, so a word may be negative.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tensors import pack_tree_mask, unpack_tree_mask

__all__ = [
    "pack_tree_mask",
    "prefix_attention_reference",
    "tree_attention_reference",
    "unpack_tree_mask",
    "write_kv_to_cache",
]


def tree_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each request's verify queries over its prefix and its tree.

    Args:
        query: queries of all requests, concatenated in ``query_start_loc`` order; rows
            past ``query_start_loc[-1]`` (padding) come back as zeros.
        key_cache, value_cache: paged cache, layout in the module docstring. The verify
            tokens' K/V must already be written (see ``write_kv_to_cache``).
        block_table: physical block ids of each request's logical blocks.
        seq_lens: total tokens of each request, verify tokens included.
        query_start_loc: cumulative query counts; requests may differ in query count.
        tree_mask: ``tree_mask[r, i, j]`` is True iff verify token ``j`` is an ancestor
            of, or equal to, verify token ``i`` (cache order). Entries at ``i`` or
            ``j >= n_r`` are padding and ignored. The packed int32 form of
            ``pack_tree_mask`` is accepted too. None means causal over the query block.
        scale: softmax scale applied to ``q . k``.

    Returns:
        The attention output in ``query.dtype``; the softmax is computed in float32.
    """
    query_lens = _check_paged_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc
    )
    if tree_mask is not None and tree_mask.dtype == torch.int32:
        tree_mask = unpack_tree_mask(tree_mask)
    if tree_mask is not None:
        _check_tree_mask(tree_mask, query_lens)

    output = torch.zeros_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, (num_queries, seq_len) in enumerate(zip(query_lens, lens, strict=True)):
        if num_queries == 0:
            continue
        rows = slice(starts[r], starts[r] + num_queries)
        # K/V of positions 0 .. seq_len - 1: [seq_len, num_kv_heads, head_dim]
        key = _gather_kv(key_cache, block_table[r], seq_len)
        value = _gather_kv(value_cache, block_table[r], seq_len)
        request_mask = None if tree_mask is None else tree_mask[r]
        mask = _verify_rows_mask(request_mask, num_queries, seq_len, query.device)
        output[rows] = _masked_attention(query[rows], key, value, mask, scale)
    return output


def prefix_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out as query; lse [num_heads, num_tokens] float32
    """Attention of each verify row over its request's prefix alone (positions
    ``< seq_len - n_r``, no mask), and its natural-log LSE: the torch twin of the
    non-causal FlashAttention call that the tree kernel's ``prefix_lse`` mode resumes
    from. As FlashAttention does, a row without prefix keys gets output 0 and LSE
    +inf; padding rows are left 0 (LSE +inf)."""
    query_lens = _check_paged_inputs(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc
    )
    output = torch.zeros_like(query)
    lse = torch.full(  # [num_heads, num_tokens], FlashAttention's softmax_lse layout
        (query.shape[1], query.shape[0]), float("inf"), device=query.device
    )
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, (num_queries, seq_len) in enumerate(zip(query_lens, lens, strict=True)):
        prefix_len = seq_len - num_queries
        if num_queries == 0 or prefix_len == 0:
            continue
        rows = slice(starts[r], starts[r] + num_queries)
        key = _gather_kv(key_cache, block_table[r], prefix_len)
        value = _gather_kv(value_cache, block_table[r], prefix_len)
        mask = torch.ones(num_queries, prefix_len, dtype=torch.bool, device=query.device)
        output[rows], lse[:, rows] = _masked_attention(
            query[rows], key, value, mask, scale, with_lse=True
        )
    return output, lse


def write_kv_to_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_slots] int, num_slots <= num_tokens
) -> None:
    """Write token ``t``'s K/V to slot ``slot_mapping[t]`` in place; slot -1 is skipped.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size``. As in vLLM's
    ``reshape_and_cache_flash``, only the first ``len(slot_mapping)`` tokens are
    written, so padded token rows need no slot. Strided cache views are written
    through.
    """
    if key.shape != value.shape or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} and key_cache "
            f"{tuple(key_cache.shape)} / value_cache {tuple(value_cache.shape)} "
            f"must match"
        )
    num_slots = slot_mapping.shape[0]
    if num_slots > key.shape[0]:
        raise ValueError(
            f"slot_mapping has {num_slots} slots for {key.shape[0]} tokens"
        )
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0  # [num_slots]
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[:num_slots][valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[:num_slots][valid].to(value_cache.dtype)


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row: torch.Tensor,  # [max_blocks_per_req]
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """Read positions ``0 .. seq_len - 1`` of one request from the paged cache."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row.to(cache.device).long()[positions // block_size]
    return cache[blocks, positions % block_size]


def _verify_rows_mask(
    tree_mask: torch.Tensor | None,  # [max_q, max_q] bool, one request's
    num_queries: int,
    seq_len: int,
    device: torch.device,
) -> torch.Tensor:  # [num_queries, seq_len] bool
    """Cached positions each verify row sees: the whole prefix plus its tree part."""
    mask = torch.ones(num_queries, seq_len, dtype=torch.bool, device=device)
    if tree_mask is None:
        verify = torch.ones(num_queries, num_queries, dtype=torch.bool, device=device)
        verify = verify.tril()
    else:
        verify = tree_mask[:num_queries, :num_queries]
    mask[:, seq_len - num_queries :] = verify
    return mask


def _masked_attention(
    query: torch.Tensor,  # [n, num_heads, head_dim]
    key: torch.Tensor,  # [s, num_kv_heads, head_dim]
    value: torch.Tensor,  # [s, num_kv_heads, head_dim]
    mask: torch.Tensor,  # [n, s] bool, at least one True per row
    scale: float,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float32; query head ``h`` reads KV head ``h // group``.
    Returns ``[n, num_heads, head_dim]`` in query.dtype, and with ``with_lse`` also
    each row's natural-log LSE of the scaled scores, ``[num_heads, n]`` float32."""
    group = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(group, dim=1)  # [s, num_heads, head_dim]
    value = value.float().repeat_interleave(group, dim=1)
    # [num_heads, n, s]
    scores = torch.einsum("qhd,khd->hqk", query.float(), key) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, value).to(query.dtype)
    return (out, torch.logsumexp(scores, dim=-1)) if with_lse else out


def _check_paged_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> list[int]:
    """Validate shapes and lengths; return the query count of each request."""
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"expected query [num_tokens, num_heads, head_dim] and equal caches "
            f"[num_blocks, block_size, num_kv_heads, head_dim], got query "
            f"{tuple(query.shape)}, key_cache {tuple(key_cache.shape)}, "
            f"value_cache {tuple(value_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads, cache_head_dim = key_cache.shape[1:]
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads of dim {head_dim}, cache has {num_kv_heads} "
            f"KV heads of dim {cache_head_dim}: need equal dims and num_heads a "
            f"multiple of num_kv_heads"
        )
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,) or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"{num_reqs} requests need query_start_loc of shape ({num_reqs + 1},) and "
            f"{num_reqs} block_table rows, got {tuple(query_start_loc.shape)} and "
            f"{tuple(block_table.shape)}"
        )
    query_lens = query_start_loc.diff().tolist()
    lens = seq_lens.tolist()
    total = query_start_loc[-1].item()
    if min(query_lens, default=0) < 0 or total > query.shape[0]:
        raise ValueError(
            f"query_start_loc {query_start_loc.tolist()} must be non-decreasing and "
            f"end at most at num_tokens={query.shape[0]}"
        )
    for r, (num_queries, seq_len) in enumerate(zip(query_lens, lens, strict=True)):
        if num_queries > seq_len or -(-seq_len // block_size) > block_table.shape[1]:
            raise ValueError(
                f"request {r}: seq_len={seq_len} must be >= its {num_queries} queries "
                f"and fit in {block_table.shape[1]} blocks of {block_size}"
            )
    return query_lens


def _check_tree_mask(
    tree_mask: torch.Tensor,  # [num_reqs, max_q, max_q] bool
    query_lens: list[int],
) -> None:
    """The mask must cover each request's verify width and let each token see itself."""
    num_reqs = len(query_lens)
    max_q = max(query_lens, default=0)
    if (
        tree_mask.dim() != 3
        or tree_mask.shape[0] != num_reqs
        or tree_mask.shape[1] != tree_mask.shape[2]
        or tree_mask.shape[1] < max_q
    ):
        raise ValueError(
            f"tree_mask must be [num_reqs={num_reqs}, max_q, max_q] with max_q >= the "
            f"largest verify width {max_q} (budget + 1, not the drafter block size), "
            f"got {tuple(tree_mask.shape)}"
        )
    for r, num_queries in enumerate(query_lens):
        if not tree_mask[r, :num_queries, :num_queries].diagonal().all():
            raise ValueError(
                f"request {r}: tree_mask diagonal must be True for its {num_queries} "
                f"verify tokens (each node attends to itself)"
            )
