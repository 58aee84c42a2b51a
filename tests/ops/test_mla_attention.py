"""Tests for vllm_ddtree/ops/mla_attention.py.

The oracle never uses the absorbed trick: it expands each request's latent rows into
per-head keys ``[kv_c W_UK | k_pe]`` and values ``kv_c W_UV`` with random ``W_UK`` and
``W_UV``, and runs plain attention (``F.scaled_dot_product_attention``) of each tree
node over the request's prefix plus that node's root-to-node branch alone. The twin's
latent output is compared after projecting it through ``W_UV``, its LSE against the
branch's log-sum-exp. Trees are random and built here (tests/ops/test_attention_reference.py's
helpers); unused cache slots hold NaN, so reading one poisons the output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from tests.ops.test_attention_reference import (
    padded_tree_mask,
    random_tree_parents,
    root_to_node,
)
from vllm_ddtree.ops.mla_attention import merge_attention_states, mla_tree_attention
from vllm_ddtree.tensors import pack_tree_mask


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    kv_lora_rank: int  # latent width, the value width of the absorbed form
    rope_dim: int
    nope_dim: int  # qk_nope_head_dim: per-head key width without rope
    v_dim: int  # v_head_dim

    @property
    def scale(self) -> float:
        return (self.nope_dim + self.rope_dim) ** -0.5


# DeepSeek-V3's and Kimi K2's latent (512 + 64 = 576), with fewer heads; and an odd one.
DSV3 = MLADims(num_heads=4, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)
ODD = MLADims(num_heads=3, kv_lora_rank=40, rope_dim=8, nope_dim=24, v_dim=20)
BUDGETS = [1, 7, 8, 16, 17, 31]
DEPTHS = [7, 15]  # drafter block sizes 8 and 16 bound the tree depth
PAGE_SIZES = [16, 64]
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@dataclass
class LatentBatch:
    dims: MLADims
    q_nope: torch.Tensor  # [num_tokens + 2, num_heads, nope_dim] float32, not absorbed
    q_pe: torch.Tensor  # [num_tokens + 2, num_heads, rope_dim] in the cache dtype
    q_absorbed: torch.Tensor  # [num_tokens + 2, num_heads, kv_lora_rank] in the cache dtype
    w_uk: torch.Tensor  # [kv_lora_rank, num_heads, nope_dim] float32
    w_uv: torch.Tensor  # [kv_lora_rank, num_heads, v_dim] float32
    kv_cache: torch.Tensor  # [num_blocks, page_size, kv_lora_rank + rope_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    latents: list[torch.Tensor]  # per request [seq_len, kv_lora_rank + rope_dim], cache dtype
    prefix_lens: list[int]
    _expanded: dict = field(default_factory=dict)  # request -> (key, value), see expanded()

    def run(self, tree_mask: torch.Tensor | None, keys: str = "all"):
        return mla_tree_attention(
            self.q_absorbed, self.q_pe, self.kv_cache, self.block_table, self.seq_lens,
            self.query_start_loc, tree_mask, self.dims.scale, keys=keys,
        )

    def expanded(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's per-head keys [num_heads, seq_len, nope + rope] and values
        [num_heads, seq_len, v_dim] in float32, expanded from its latents (once)."""
        if r not in self._expanded:
            latent = self.latents[r].float()
            kv_c, k_pe = latent.split([self.dims.kv_lora_rank, self.dims.rope_dim], dim=-1)
            k_nope = torch.einsum("sl,lhp->hsp", kv_c, self.w_uk)
            key = torch.cat([k_nope, k_pe.expand(self.dims.num_heads, -1, -1)], dim=-1)
            self._expanded[r] = key, torch.einsum("sl,lhv->hsv", kv_c, self.w_uv)
        return self._expanded[r]


def make_latent_batch(
    query_lens: list[int],
    prefix_lens: list[int],
    dims: MLADims,
    dtype: torch.dtype,
    seed: int,
    page_size: int = 16,
    strided: bool = False,
) -> LatentBatch:
    """Random latents written through shuffled blocks into a NaN cache. ``strided``
    makes the cache a slice of a wider allocation (a non-contiguous view)."""
    gen = torch.Generator().manual_seed(seed)
    width = dims.kv_lora_rank + dims.rope_dim
    seq_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    pages = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(pages) + 3  # spare blocks stay NaN
    physical = torch.randperm(num_blocks, generator=gen)
    block_table = torch.randint(0, num_blocks, (len(seq_lens), max(pages) + 2), generator=gen)
    first = 0
    for r, count in enumerate(pages):
        block_table[r, :count] = physical[first : first + count]
        first += count
    alloc = torch.full((num_blocks, page_size, width + 8 * strided), float("nan"), dtype=dtype)
    kv_cache = alloc[..., :width]
    latents = []
    for r, seq_len in enumerate(seq_lens):
        latent = torch.randn(seq_len, width, generator=gen).to(dtype)
        positions = torch.arange(seq_len)
        blocks = block_table[r, positions // page_size]
        kv_cache[blocks, positions % page_size] = latent  # slot = block * page + offset
        latents.append(latent)
    num_tokens = sum(query_lens) + 2  # two padding rows
    heads, rank = dims.num_heads, dims.kv_lora_rank
    w_uk = torch.randn(rank, heads, dims.nope_dim, generator=gen) / rank**0.5
    w_uv = torch.randn(rank, heads, dims.v_dim, generator=gen) / rank**0.5
    q_nope = torch.randn(num_tokens, heads, dims.nope_dim, generator=gen)
    q_pe = torch.randn(num_tokens, heads, dims.rope_dim, generator=gen).to(dtype)
    return LatentBatch(
        dims=dims,
        q_nope=q_nope,
        q_pe=q_pe,
        q_absorbed=torch.einsum("thp,lhp->thl", q_nope, w_uk).to(dtype),
        w_uk=w_uk,
        w_uv=w_uv,
        kv_cache=kv_cache,
        block_table=block_table.to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        latents=latents,
        prefix_lens=prefix_lens,
    )


def expanded_branch_oracle(
    batch: LatentBatch, r: int, parents: list[int], node: int
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_heads, v_dim], [num_heads] float32
    """Plain MLA (no absorption) of one node over prefix + its branch: the node is the
    branch's last token, so causal attention sees every key of that sequence."""
    dims, prefix_len = batch.dims, batch.prefix_lens[r]
    positions = list(range(prefix_len)) + [prefix_len + j for j in root_to_node(parents, node)]
    key, value = (t[:, positions] for t in batch.expanded(r))  # [num_heads, s, ...]
    row = int(batch.query_start_loc[r]) + node
    query = torch.cat([batch.q_nope[row], batch.q_pe[row].float()], dim=-1)[:, None]
    out = F.scaled_dot_product_attention(query, key, value, scale=dims.scale)[:, 0]
    lse = torch.logsumexp((query @ key.transpose(1, 2))[:, 0] * dims.scale, dim=-1)
    return out, lse


def project(batch: LatentBatch, latent_out: torch.Tensor) -> torch.Tensor:
    """Latent output [tokens, heads, rank] -> per-head values [tokens, heads, v_dim]."""
    return torch.einsum("thl,lhv->thv", latent_out.float(), batch.w_uv)


def assert_matches_expanded_oracle(
    batch: LatentBatch, trees: list[list[int]], out: torch.Tensor, lse: torch.Tensor
) -> None:
    dims = batch.dims
    assert out.shape == (batch.q_pe.shape[0], dims.num_heads, dims.kv_lora_rank)
    assert out.dtype == batch.q_absorbed.dtype and lse.dtype == torch.float32
    assert lse.shape == (dims.num_heads, out.shape[0])
    tol = TOLERANCES[out.dtype]
    values = project(batch, out)
    for r, parents in enumerate(trees):
        first = int(batch.query_start_loc[r])
        for node in range(len(parents)):
            expected_out, expected_lse = expanded_branch_oracle(batch, r, parents, node)
            torch.testing.assert_close(values[first + node], expected_out, atol=tol, rtol=tol)
            torch.testing.assert_close(lse[:, first + node], expected_lse, atol=tol, rtol=tol)
    num_queries = sum(len(parents) for parents in trees)
    assert torch.all(out[num_queries:] == 0), "padding rows must stay zero"
    assert torch.all(lse[:, num_queries:] == float("inf")), "padding rows have no keys"


def random_trees(budgets: list[int], max_depth: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tree_parents(b + 1, max_depth, rng) for b in budgets]


def check_random_trees(budgets, prefix_lens, max_depth, dims, dtype, seed, packed=False,
                       **batch_options) -> None:
    trees = random_trees(budgets, max_depth, seed)
    query_lens = [len(t) for t in trees]
    batch = make_latent_batch(query_lens, prefix_lens, dims, dtype, seed, **batch_options)
    # Wider than the widest request, with garbage padding that must be ignored.
    mask = padded_tree_mask(trees, max(query_lens) + 3, seed)
    out, lse = batch.run(pack_tree_mask(mask) if packed else mask)
    assert_matches_expanded_oracle(batch, trees, out, lse)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("max_depth", DEPTHS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_every_branch_matches_expanded_mla(budget, max_depth, page_size):
    # Prefix 0: a request whose only context is its own tree; 70 spans pages.
    seed = budget * 41 + max_depth + page_size
    check_random_trees([budget] * 3, [0, 9, 70], max_depth, DSV3, torch.float32, seed,
                       packed=True, page_size=page_size)


@pytest.mark.parametrize("budget", BUDGETS)
def test_odd_shapes(budget):
    check_random_trees([budget, budget // 2, 1], [5, 0, 33], 7, ODD, torch.float32,
                       seed=budget, page_size=[1, 5, 16][budget % 3])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_bfloat16_matches_float32_oracle(budget, page_size):
    check_random_trees([budget] * 2, [0, 23], 7, DSV3, torch.bfloat16, seed=budget,
                       page_size=page_size)


def test_mixed_budgets_and_strided_cache():
    # Budget 0 is a plain decode row (root only); the widest request sizes the mask.
    check_random_trees([16, 0, 7, 31, 1, 17], [3, 0, 50, 0, 16, 9], 15, ODD,
                       torch.float32, seed=7, strided=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_prefix_pass_and_tree_pass_merge_to_one_pass(budget, page_size, dtype):
    """The GPU route: a non-causal pass over the prefix (the backend's kernel), a pass
    over the tree alone, merged by LSE, equals attending to both at once."""
    trees = random_trees([budget, budget, 3], 15, seed=budget + page_size)
    query_lens = [len(t) for t in trees]
    batch = make_latent_batch(query_lens, [40, 0, 130], DSV3, dtype, budget, page_size)
    mask = pack_tree_mask(padded_tree_mask(trees, max(query_lens), budget))
    prefix_out, prefix_lse = batch.run(None, keys="prefix")
    tree_out, tree_lse = batch.run(mask, keys="tree")
    out, lse = merge_attention_states(prefix_out, prefix_lse, tree_out, tree_lse)
    one_out, one_lse = batch.run(mask)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), one_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, one_lse, atol=1e-5, rtol=1e-5)
    assert_matches_expanded_oracle(batch, trees, out, lse)
    # Request 1 has no prefix: its prefix pass has no keys (output 0, LSE +inf).
    rows = slice(query_lens[0], query_lens[0] + query_lens[1])
    assert torch.all(prefix_out[rows] == 0) and torch.all(prefix_lse[:, rows] == float("inf"))


def test_merge_agrees_with_vllm_merge_attn_states():
    """The GPU route merges with vLLM's merge_attn_states: same output and LSE,
    including rows with no keys on one side (either infinity) or on both."""
    merge_module = pytest.importorskip("vllm.v1.attention.ops.merge_attn_states")
    gen = torch.Generator().manual_seed(3)
    out_a, out_b = torch.randn(2, 6, 4, 32, generator=gen)
    lse_a, lse_b = torch.randn(2, 4, 6, generator=gen) * 3
    lse_a[0, 1], lse_a[2, 2], lse_b[1, 3] = float("inf"), float("-inf"), float("inf")
    lse_a[3, 5] = lse_b[3, 5] = float("inf")
    out_a[0, 1] = out_a[2, 2] = out_b[3, 1] = out_a[5, 3] = out_b[5, 3] = 0.0
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    expected = torch.empty_like(out)
    expected_lse = torch.empty_like(lse)
    merge_module.merge_attn_states(expected, out_a, lse_a, out_b, lse_b, expected_lse)
    torch.testing.assert_close(out, expected)
    finite = expected_lse.isfinite()
    torch.testing.assert_close(lse[finite], expected_lse[finite])
    # No keys on either side: vLLM writes log(0); this module keeps FlashAttention's +inf.
    assert lse[3, 5] == float("inf") and expected_lse[3, 5] == float("-inf")
    assert torch.all(out[5, 3] == 0)
    # One side empty: the other side's output and LSE, exactly.
    assert torch.equal(out[1, 0], out_b[1, 0]) and lse[0, 1] == lse_b[0, 1]


def test_chain_mask_equals_no_mask():
    query_lens = [4, 9]
    batch = make_latent_batch(query_lens, [6, 0], ODD, torch.float32, seed=5)
    chains = [list(range(-1, n - 1)) for n in query_lens]
    out, lse = batch.run(padded_tree_mask(chains, 9, 1))
    causal_out, causal_lse = batch.run(None)
    torch.testing.assert_close(out, causal_out)
    torch.testing.assert_close(lse, causal_lse)


def test_mask_sized_by_block_size_is_rejected():
    # The seed bug: a mask sized by the drafter block size (8) for budget 16.
    batch = make_latent_batch([17], [4], ODD, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"budget \+ 1"):
        batch.run(torch.ones(1, 8, 8, dtype=torch.bool).tril())


def test_bad_inputs_are_rejected():
    batch = make_latent_batch([3], [4], ODD, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"kv_lora_rank \+ rope_dim"):
        mla_tree_attention(batch.q_absorbed, batch.q_pe, batch.kv_cache[..., :-1],
                           batch.block_table, batch.seq_lens, batch.query_start_loc,
                           None, 0.1)
    with pytest.raises(ValueError, match=r"keys='chain'"):
        batch.run(None, keys="chain")
    with pytest.raises(ValueError, match=r"LSEs \[num_heads, num_tokens\]"):
        merge_attention_states(batch.q_absorbed, torch.zeros(5, 3), batch.q_absorbed,
                               torch.zeros(5, 3))
