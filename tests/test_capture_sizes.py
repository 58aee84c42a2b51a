"""vllm_ddtree/capture_sizes.py: a DDTree engine captures a CUDA graph for every
uniform verify step up to max_num_seqs requests (bounded), and leaves the user's own
choice, eager engines and other engines alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ddtree.capture_sizes import (
    MAX_CAPTURE_REQUESTS,
    MAX_CAPTURE_TOKENS,
    ddtree_capture_sizes,
    request_counts,
    token_grid,
)
from vllm_ddtree.config import DDTreeConfig


def vllm_config(budget=16, block_size=8, max_num_seqs=64, max_tokens=8192, eager=False,
                sizes=None, max_size=None, ddtree=True, schedule=None):
    spec = SimpleNamespace(ddtree=DDTreeConfig(budget=budget, block_size=block_size,
                                               vocab_size=1000),
                           num_speculative_tokens_per_batch_size=schedule) if ddtree else None
    return SimpleNamespace(
        speculative_config=spec,
        model_config=SimpleNamespace(enforce_eager=eager),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_tokens),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=sizes,
                                           max_cudagraph_capture_size=max_size),
    )


def test_the_grid_is_vllms():
    assert token_grid(512) == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert request_counts(30) == [1, 2, 4, 8, 16, 24, 30]


@pytest.mark.parametrize("budget,block_size,max_num_seqs", [
    (16, 8, 64), (1, 16, 256), (7, 8, 48), (31, 16, 128), (64, 8, 100), (16, 8, 1024),
])
def test_every_uniform_verify_step_up_to_max_num_seqs_has_a_graph(budget, block_size,
                                                                   max_num_seqs):
    sizes = ddtree_capture_sizes(vllm_config(budget, block_size, max_num_seqs))
    assert sizes == sorted(set(sizes))
    width = budget + 1
    covered = [n for n in range(1, max_num_seqs + 1)
               if any(s % width == 0 and s >= n * width for s in sizes)]
    # Every batch up to max_num_seqs (and the bounds) pads to a captured verify size.
    assert covered == list(range(1, min(max_num_seqs, MAX_CAPTURE_REQUESTS,
                                        MAX_CAPTURE_TOKENS // width) + 1))
    assert max(sizes) <= MAX_CAPTURE_TOKENS
    assert set(token_grid(min(512, max(sizes)))) <= set(sizes)  # vLLM's grid stays
    assert {block_size * n for n in (1, 2, 4)} <= set(sizes)  # the drafter's passes


def test_the_chain_default_of_512_tokens_no_longer_bounds_ddtree():
    """At budget 16 vLLM's default stopped graphs at 30 requests (512 // 17); the
    chain's 16-row steps reach 32. DDTree's engine now covers its max_num_seqs."""
    sizes = ddtree_capture_sizes(vllm_config(16, 8, 64))
    assert 32 * 17 in sizes and 64 * 17 in sizes


def test_vllms_default_max_num_seqs_is_bounded_by_requests():
    """At vLLM's default of up to 1024 sequences the sizes stop at 256 requests per
    width (320 sizes for steps of up to 481 requests before this bound, on an H100
    about 100 s of start-up); every width still reaches 256 requests."""
    from vllm_ddtree.spec_config import adaptive_schedule

    config = vllm_config(16, 8, 1024, max_tokens=16384, schedule=adaptive_schedule(16))
    sizes = ddtree_capture_sizes(config)
    assert max(sizes) == MAX_CAPTURE_REQUESTS * 17
    for width in (1, 3, 5, 8, 9, 17):
        assert MAX_CAPTURE_REQUESTS * width in sizes, width
    assert 257 * 17 not in sizes and len(sizes) < 200


def test_trees_sized_per_step_get_a_graph_at_every_size():
    from vllm_ddtree.spec_config import adaptive_schedule

    sizes = ddtree_capture_sizes(vllm_config(16, 8, 64, schedule=adaptive_schedule(16)))
    for k in (2, 4, 8, 16):
        assert {n * (k + 1) for n in (1, 8, 32, 64)} <= set(sizes), k
    assert max(sizes) <= MAX_CAPTURE_TOKENS


def test_bounded_by_the_batch_token_limit_and_the_ceiling():
    sizes = ddtree_capture_sizes(vllm_config(64, 16, 256, max_tokens=2048))
    assert max(sizes) <= 2048 and 31 * 65 in sizes and 32 * 65 not in sizes
    sizes = ddtree_capture_sizes(vllm_config(512, 16, 256, max_tokens=1 << 20))
    assert max(sizes) <= MAX_CAPTURE_TOKENS


@pytest.mark.parametrize("change", [
    {"sizes": [1, 2, 4]}, {"max_size": 1024}, {"eager": True}, {"ddtree": False},
], ids=["user-sizes", "user-ceiling", "eager", "not-ddtree"])
def test_vllms_choice_stands_where_the_plugin_has_none_to_make(change):
    assert ddtree_capture_sizes(vllm_config(**change)) is None


def test_vllm_keeps_the_sizes_for_a_ddtree_engine(monkeypatch):
    """Through the patch of VllmConfig._set_cudagraph_sizes: the sizes reach the config
    as if listed by the user, and vLLM's own step after it keeps them."""
    from vllm_ddtree import patches

    seen = []
    monkeypatch.setitem(patches._orig, "VllmConfig._set_cudagraph_sizes", None)
    config = vllm_config(16, 8, 64)
    monkeypatch.delitem(patches._orig, "VllmConfig._set_cudagraph_sizes")
    from vllm.config import VllmConfig

    original = VllmConfig._set_cudagraph_sizes
    monkeypatch.setattr(VllmConfig, "_set_cudagraph_sizes",
                        lambda self: seen.append(list(self.compilation_config
                                                      .cudagraph_capture_sizes)))
    patches._patch_cudagraph_sizes()
    try:
        VllmConfig._set_cudagraph_sizes(config)
    finally:
        VllmConfig._set_cudagraph_sizes = original
        patches._orig.pop("VllmConfig._set_cudagraph_sizes", None)
    assert seen == [ddtree_capture_sizes(vllm_config(16, 8, 64))]
