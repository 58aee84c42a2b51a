"""vllm_ddtree/runner.py pieces that need no engine: the start-up backend check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.attention import cuda
from vllm_ddtree.runner import check_tree_backends


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
