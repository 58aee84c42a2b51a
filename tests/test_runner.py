"""vllm_ddtree/runner.py pieces that need no engine: the start-up backend check and
the tree published for tree-less batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.attention import cuda
from vllm_ddtree.runner import attention_info, check_tree_backends


class PlatformBackend:
    """A vLLM backend without tree attention (no move_kv_slots_layers)."""


def fake_runner(backends: dict[str, type], draft_layers=()) -> SimpleNamespace:
    layers = {
        name: SimpleNamespace(kv_cache=[torch.zeros(2, 2, 4, 8)], attn_backend=backend)
        for name, backend in backends.items()
    }
    return SimpleNamespace(
        ddtree_state=object(),
        drafter=SimpleNamespace(_draft_attn_layer_names=set(draft_layers)),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        kv_cache_config=SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=list(backends))]
        ),
    )


def test_every_target_layer_has_a_tree_backend():
    runner = fake_runner({f"model.layers.{i}.attn": cuda.DDTreeTritonAttentionBackend
                          for i in range(3)})
    check_tree_backends(runner)


def test_a_platform_backend_fails_at_start_up_naming_the_layer():
    runner = fake_runner({"model.layers.0.attn": cuda.DDTreeFlashAttentionBackend,
                          "model.layers.1.attn": PlatformBackend})
    with pytest.raises(NotImplementedError,
                       match=r"layer model.layers.1.attn uses PlatformBackend, which has none"):
        check_tree_backends(runner)


def test_drafter_layers_and_non_ddtree_runners_are_not_checked():
    drafter_layer = {"model.layers.0.attn": cuda.DDTreeFlashAttentionBackend,
                     "draft.layers.0.attn": PlatformBackend}
    check_tree_backends(fake_runner(drafter_layer, draft_layers=["draft.layers.0.attn"]))
    plain = fake_runner({"model.layers.0.attn": PlatformBackend})
    plain.ddtree_state = None
    check_tree_backends(plain)


def verify_runner(device: str, query_lens: list[int], budget: int = 3) -> SimpleNamespace:
    """A runner whose step carries no tree, with vLLM's host query offsets."""
    from vllm_ddtree.attention.state import mask_buffer
    from vllm_ddtree.config import DDTreeConfig

    ddtree = DDTreeConfig(budget=budget, topk_cap=None, block_size=8, vocab_size=50)
    starts = torch.zeros(8, dtype=torch.int32)
    starts[1 : len(query_lens) + 1] = torch.tensor(query_lens).cumsum(0)
    state = SimpleNamespace(ddtree=ddtree, attn_info=None,
                            mask_buffer=mask_buffer(4, budget + 1, torch.device("cpu")))
    return SimpleNamespace(device=torch.device(device), ddtree_state=state,
                           query_start_loc=SimpleNamespace(cpu=starts))


def test_uniform_batches_without_trees_get_a_causal_tree_on_cuda():
    """vLLM runs every batch of budget + 1 rows per request in the full CUDA graph it
    captured with the tree kernel, so such a batch needs a (causal) tree even when it
    is a prefill; other batches, and the CPU (no graphs), keep the parent's kernel."""
    runner = verify_runner("cuda", [4, 4])
    info = attention_info(runner, num_tokens=8, num_reqs=2, max_query_len=4, for_capture=False)
    assert info is not None and info.all_rows_are_tree_rows
    assert info.num_rows.tolist() == [4, 4] and info.row_start.tolist() == [0, 4]
    assert torch.equal(info.tree_mask[1], torch.ones(4, 4, dtype=torch.bool).tril())
    assert info.mask_buffer is runner.ddtree_state.mask_buffer
    # Not uniform: a full graph never runs it.
    ragged = verify_runner("cuda", [4, 2])
    assert attention_info(ragged, 6, 2, 4, for_capture=False) is None
    # ... except at capture, whose dummy batch may end in a shorter request.
    captured = attention_info(ragged, 6, 2, 4, for_capture=True)
    assert captured is not None and captured.num_rows.tolist() == [4, 2]
    assert attention_info(verify_runner("cuda", [1, 1]), 2, 2, 1, for_capture=True) is None
    assert attention_info(verify_runner("cpu", [4, 4]), 8, 2, 4, for_capture=False) is None


def test_a_step_with_trees_publishes_its_own():
    runner = verify_runner("cuda", [4, 4])
    runner.ddtree_state.attn_info = step_info = object()
    assert attention_info(runner, 8, 2, 4, for_capture=True) is step_info
