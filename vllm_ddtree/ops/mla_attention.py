"""Tree attention for MLA verify rows, in plain torch over the latent cache.

The torch twin of the MLA tree path: the oracle for a GPU kernel over the same cache,
and the reference the MLA backends' tree rows are checked against. It loops over
requests for clarity, not speed, as ``attention_reference.py`` does; verify rows,
``seq_lens``, ``query_start_loc``, block tables and the (bool or packed) ancestor mask
mean exactly what they mean there.

MLA in absorbed (MQA) form. An MLA layer caches one latent row per token, shared by
all heads: ``kv_cache`` is ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
(512 + 64 = 576 for DeepSeek-V3 and Kimi K2), the normalised latent ``kv_c`` first,
the rotated ``k_pe`` after it. vLLM's decode path (``forward_mqa``) folds the key
up-projection into the query, ``q_nope_absorbed[t, h] = W_UK[:, h] @ q_nope[t, h]``,
so every head attends over the same latent rows:

    score(t, h, s) = scale * (q_nope_absorbed[t, h] . kv_c[s] + q_pe[t, h] . k_pe[s])
    out(t, h)      = sum_s softmax_s(score) * kv_c[s]       # [kv_lora_rank], latent

and the caller applies ``W_UV`` (then ``o_proj``) to the latent output. ``scale`` is
the layer's, ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` times any YaRN mscale.

Spans. ``keys="all"`` is the one-pass result: the whole prefix unmasked plus the
row's tree ancestors. ``keys="prefix"`` is the prefix alone, the twin of a backend's
non-causal decode call over ``seq_lens - n_r`` keys; ``keys="tree"`` is the verify
keys alone under the ancestor mask. ``merge_attention_states`` combines the last two
into the first by their LSEs, as vLLM's ``merge_attn_states`` does.

LSE. Natural log of each row's summed ``exp(score)``, float32, laid out
``[num_heads, num_tokens]`` as FlashAttention's ``softmax_lse``. A row with no key in
its span (a prefix pass at prefix length 0, or a padding row) has output 0 and LSE
+inf, FlashAttention's convention; the merge treats either infinity as "no keys".
"""

from __future__ import annotations

from typing import Literal

import torch

from vllm_ddtree.ops.attention_reference import _check_tree_mask, _gather_kv
from vllm_ddtree.tensors import unpack_tree_mask

__all__ = ["merge_attention_states", "mla_tree_attention"]

Span = Literal["all", "prefix", "tree"]
NO_KEYS_LSE = float("inf")  # FlashAttention's LSE of a row with no keys


def mla_tree_attention(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank], W_UK absorbed
    q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim], rotated
    kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the verify tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor | None,  # [num_reqs, max_q, max_q] bool, or packed int32
    scale: float,
    keys: Span = "all",
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_tokens, num_heads, kv_lora_rank]
    #                                      lse [num_heads, num_tokens] float32
    """Absorbed MLA attention of each request's verify rows over its latent cache.

    Args:
        q_nope, q_pe: the rows' absorbed no-rope and rotated rope query parts, in
            ``query_start_loc`` order; rows past ``query_start_loc[-1]`` are padding.
        kv_cache: one layer's latent cache; strided views (a slice of a larger
            allocation) are read as they are. The verify rows' latents must
            already be written (vLLM writes them before calling forward_mqa).
        block_table, seq_lens, query_start_loc: as in ``tree_attention_reference``.
        tree_mask: ``[r, i, j]`` True iff verify token ``j`` is an ancestor of, or
            is, verify token ``i``; or its ``pack_tree_mask`` form; None means causal
            over the verify block (a chain). Sized by budget + 1, never by the
            drafter's block size. Unused with ``keys="prefix"``.
        scale: softmax scale of the scores.
        keys: which keys each row attends to (module docstring).

    Returns:
        The latent output in ``q_nope.dtype`` (softmax in float32) and its LSE.
    """
    query_lens = _check_mla_inputs(
        q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, keys
    )
    if keys != "prefix" and tree_mask is not None:
        if tree_mask.dtype == torch.int32:
            tree_mask = unpack_tree_mask(tree_mask)
        _check_tree_mask(tree_mask, query_lens)

    num_tokens, num_heads, rank = q_nope.shape
    out = q_nope.new_zeros(num_tokens, num_heads, rank)
    lse = torch.full((num_heads, num_tokens), NO_KEYS_LSE, device=q_nope.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, (num_queries, seq_len) in enumerate(zip(query_lens, lens, strict=True)):
        first, last = _key_range(keys, seq_len, num_queries)
        if num_queries == 0 or first == last:
            continue
        rows = slice(starts[r], starts[r] + num_queries)
        # This request's latent rows at positions first .. last - 1: [s, rank + rope]
        latent = _gather_kv(kv_cache, block_table[r], last)[first:]
        request_mask = None if tree_mask is None else tree_mask[r]
        visible = _visible_keys(request_mask, keys, num_queries, seq_len, q_nope.device)
        out[rows], lse[:, rows] = _latent_attention(
            q_nope[rows], q_pe[rows], latent, visible, scale
        )
    return out, lse


def merge_attention_states(
    out_a: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    lse_a: torch.Tensor,  # [num_heads, num_tokens] float32, natural log
    out_b: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    lse_b: torch.Tensor,  # [num_heads, num_tokens] float32, natural log
) -> tuple[torch.Tensor, torch.Tensor]:  # out as out_a; lse [num_heads, num_tokens]
    """Attention over the union of two disjoint key sets from the attention over each.

    With ``w_x = exp(lse_x - max(lse_a, lse_b))``, the union's output is
    ``(w_a out_a + w_b out_b) / (w_a + w_b)`` and its LSE ``max + log(w_a + w_b)``.
    An infinite LSE (either sign) means "no keys": that side gets weight 0; a row
    with no keys on either side gets output 0 and LSE +inf.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != (
        out_a.shape[1], out_a.shape[0]
    ):
        raise ValueError(
            f"expected outputs [num_tokens, num_heads, head_dim] of one shape and LSEs "
            f"[num_heads, num_tokens], got {tuple(out_a.shape)}, {tuple(out_b.shape)}, "
            f"{tuple(lse_a.shape)}, {tuple(lse_b.shape)}"
        )
    lse_a, lse_b = _empty_as_minus_inf(lse_a), _empty_as_minus_inf(lse_b)
    top = torch.maximum(lse_a, lse_b)
    empty = top == float("-inf")  # [num_heads, num_tokens]
    top = top.masked_fill(empty, 0.0)
    w_a, w_b = (lse_a - top).exp(), (lse_b - top).exp()  # exp(-inf) = 0
    total = (w_a + w_b).masked_fill(empty, 1.0)
    # [num_tokens, num_heads, 1] weights of each side
    share_a, share_b = (w_a / total).T[..., None], (w_b / total).T[..., None]
    out = (out_a.float() * share_a + out_b.float() * share_b).to(out_a.dtype)
    lse = (top + total.log()).masked_fill(empty, NO_KEYS_LSE)
    return out, lse


def _key_range(keys: Span, seq_len: int, num_queries: int) -> tuple[int, int]:
    """Positions [first, last) of a request's keys in the span."""
    prefix_len = seq_len - num_queries
    if keys == "prefix":
        return 0, prefix_len
    return (prefix_len if keys == "tree" else 0), seq_len


def _visible_keys(
    tree_mask: torch.Tensor | None,  # [max_q, max_q] bool, one request's
    keys: Span,
    num_queries: int,
    seq_len: int,
    device: torch.device,
) -> torch.Tensor:  # [num_queries, keys in the span] bool
    """Which keys of the span each verify row sees: every prefix key, and the verify
    keys its ancestor mask (or, without one, causality) allows."""
    prefix = torch.ones(num_queries, seq_len - num_queries, dtype=torch.bool, device=device)
    if keys == "prefix":
        return prefix
    if tree_mask is None:
        tree = torch.ones(num_queries, num_queries, dtype=torch.bool, device=device).tril()
    else:
        tree = tree_mask[:num_queries, :num_queries].to(device)
    return tree if keys == "tree" else torch.cat([prefix, tree], dim=1)


def _latent_attention(
    q_nope: torch.Tensor,  # [n, num_heads, rank]
    q_pe: torch.Tensor,  # [n, num_heads, rope]
    latent: torch.Tensor,  # [s, rank + rope]: kv_c | k_pe
    visible: torch.Tensor,  # [n, s] bool, at least one True per row
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [n, num_heads, rank], [num_heads, n] float32
    """Softmax MQA over shared latent keys in float32: the value is ``kv_c`` itself."""
    rank = q_nope.shape[-1]
    kv_c, k_pe = latent.float().split([rank, latent.shape[-1] - rank], dim=-1)
    scores = (  # [num_heads, n, s]
        torch.einsum("qhl,sl->hqs", q_nope.float(), kv_c)
        + torch.einsum("qhr,sr->hqs", q_pe.float(), k_pe)
    ) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hqs,sl->qhl", torch.softmax(scores, dim=-1), kv_c)
    return out.to(q_nope.dtype), torch.logsumexp(scores, dim=-1)


def _empty_as_minus_inf(lse: torch.Tensor) -> torch.Tensor:
    """float32 LSE with FlashAttention's +inf ("no keys") turned into log(0)."""
    lse = lse.float()
    return lse.masked_fill(lse == float("inf"), float("-inf"))


def _check_mla_inputs(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    keys: str,
) -> list[int]:
    """Validate shapes, the span and lengths; return each request's query count."""
    if keys not in ("all", "prefix", "tree"):
        raise ValueError(f"keys={keys!r}: expected 'all', 'prefix' or 'tree'")
    if (
        q_nope.dim() != 3
        or q_pe.shape[:2] != q_nope.shape[:2]
        or q_pe.dim() != 3
        or kv_cache.dim() != 3
        or kv_cache.shape[-1] != q_nope.shape[-1] + q_pe.shape[-1]
    ):
        raise ValueError(
            f"expected q_nope [num_tokens, num_heads, kv_lora_rank], q_pe [num_tokens, "
            f"num_heads, rope_dim] and kv_cache [num_blocks, block_size, kv_lora_rank + "
            f"rope_dim], got {tuple(q_nope.shape)}, {tuple(q_pe.shape)} and "
            f"{tuple(kv_cache.shape)}"
        )
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,) or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"{num_reqs} requests need query_start_loc of shape ({num_reqs + 1},) and "
            f"{num_reqs} block_table rows, got {tuple(query_start_loc.shape)} and "
            f"{tuple(block_table.shape)}"
        )
    query_lens = query_start_loc.diff().tolist()
    if min(query_lens, default=0) < 0 or query_start_loc[-1].item() > q_nope.shape[0]:
        raise ValueError(
            f"query_start_loc {query_start_loc.tolist()} must be non-decreasing and "
            f"end at most at num_tokens={q_nope.shape[0]}"
        )
    block_size = kv_cache.shape[1]
    for r, (num_queries, seq_len) in enumerate(
        zip(query_lens, seq_lens.tolist(), strict=True)
    ):
        if num_queries > seq_len or -(-seq_len // block_size) > block_table.shape[1]:
            raise ValueError(
                f"request {r}: seq_len={seq_len} must be >= its {num_queries} queries "
                f"and fit in {block_table.shape[1]} blocks of {block_size}"
            )
    return query_lens
