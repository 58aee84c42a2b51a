"""Each query tile's visible tree keys (vllm_ddtree/kernels/tile_keys.py):
the torch twin against sets of ancestors in plain Python, and the Triton kernel
against the twin, exactly. Masks are random trees padded with garbage (bits past a
request's verify tokens must not be listed), over mixed query lengths, a request
with no verify token, tiles of non-power-of-two token counts, and widths that end
mid-word and span 1 to 17 words. The kernel runs on CUDA, or on the CPU through
Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.ops.test_attention_reference import padded_tree_mask, random_tree_parents
from tests.triton_utils import DEVICE, needs_kernel
from vllm_ddtree.kernels.tile_keys import (
    list_tile_keys,
    list_tile_keys_reference,
    tile_keys_width,
)
from vllm_ddtree.tensors import pack_tree_mask


def batch(widths: list[int], width: int, seed: int):
    """(packed masks [num_reqs, width, words], query_start_loc, bool masks)."""
    rng = random.Random(seed)
    trees = [random_tree_parents(n, 15, rng) if n else [] for n in widths]
    mask = padded_tree_mask(trees, width, seed)
    query_start_loc = torch.zeros(len(widths) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(widths).cumsum(0)
    return pack_tree_mask(mask), query_start_loc, mask


def oracle(mask: torch.Tensor, widths: list[int], tokens_per_tile: int, num_tiles: int):
    """keys[r][t]: sorted j < n_r that some row of tile t sees (ancestor or self)."""
    return [[sorted({j for i in range(t * tokens_per_tile, min(n, (t + 1) * tokens_per_tile))
                     for j in range(n) if mask[r, i, j]})
             for t in range(num_tiles)] for r, n in enumerate(widths)]


CASES = {  # widths, mask width, tokens per tile
    "budget16": ([17, 5, 0, 17], 17, 8),
    "budget64_odd_tiles": ([65, 1, 40], 65, 6),
    "budget255": ([256, 100], 256, 16),
    "budget512": ([513, 257], 513, 16),
    "one_token_tiles": ([33, 2], 33, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_twin_lists_each_tiles_keys(name: str):
    widths, width, tokens_per_tile = CASES[name]
    packed, query_start_loc, mask = batch(widths, width, seed=len(name))
    num_tiles = -(-max(widths) // tokens_per_tile) + 1  # one tile past every request
    keys, counts = list_tile_keys_reference(packed, query_start_loc, tokens_per_tile,
                                            num_tiles)
    assert keys.shape == (len(widths), num_tiles, tile_keys_width(width))
    want = oracle(mask, widths, tokens_per_tile, num_tiles)
    for r in range(len(widths)):
        for t in range(num_tiles):
            n = int(counts[r, t])
            assert keys[r, t, :n].tolist() == want[r][t]
            assert not keys[r, t, n:].any()
    assert counts[:, -1].eq(0).all()
    # The lists are short: the reason they exist (fewer key steps per tile).
    if name == "budget255":
        assert counts[0].float().mean() < width / 4


@needs_kernel
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_twin(name: str):
    widths, width, tokens_per_tile = CASES[name]
    packed, query_start_loc, _ = batch(widths, width, seed=len(name) + 7)
    num_tiles = -(-max(widths) // tokens_per_tile) + 1
    want_keys, want_counts = list_tile_keys_reference(packed, query_start_loc,
                                                      tokens_per_tile, num_tiles)
    keys, counts = list_tile_keys(packed.to(DEVICE), query_start_loc.to(DEVICE),
                                  tokens_per_tile, num_tiles)
    assert torch.equal(counts.cpu(), want_counts)
    assert torch.equal(keys.cpu(), want_keys)  # both zero past each count


@needs_kernel
def test_strided_mask_view():
    # A step's corner of the persistent mask buffer (state.packed_view): row strides
    # of the buffer, not of the corner.
    widths = [17, 9]
    packed, query_start_loc, _ = batch(widths, 17, seed=3)
    buffer = torch.zeros(4, 33, 2, dtype=torch.int32)
    buffer[:2, :17, :1] = packed
    view = buffer.to(DEVICE)[:2, :17, :1]
    keys, counts = list_tile_keys(view, query_start_loc.to(DEVICE), 4, 5)
    want_keys, want_counts = list_tile_keys_reference(packed, query_start_loc, 4, 5)
    assert torch.equal(counts.cpu(), want_counts) and torch.equal(keys.cpu(), want_keys)


def test_bad_inputs_are_rejected():
    packed, query_start_loc, _ = batch([5], 5, seed=1)
    with pytest.raises(ValueError, match="int32"):
        list_tile_keys(packed.to(torch.int64), query_start_loc, 4, 2)
    with pytest.raises(ValueError, match=">= 1"):
        list_tile_keys(packed, query_start_loc, 0, 2)
