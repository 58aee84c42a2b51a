"""DDTree inside vLLM on CUDA: greedy output, bf16 match rate, chain equivalence.

Runs on a GPU with vLLM for CUDA (skipped elsewhere). Every DDTree engine here
runs with ``VLLM_DDTREE_CHECK_SYNC=1``, so any host-device synchronisation in
the plugin's part of a step (tree build, depth positions, tree attention,
walk, compaction) raises and fails the test.

- float32 (vLLM picks TRITON_ATTN, whose DDTree subclass runs the tree
  kernel): greedy DDTree equals non-speculative greedy, eager and with
  torch.compile + CUDA graphs, for budgets {1, 7, 8, 16, 17, 31, 64} at batch
  16 and batch 1, drafts scripted from vLLM's own non-speculative output
  (tests/scripted_drafter.py) so trees are accepted partially and fully at many
  depths and sibling ranks. The oracle is independent of vLLM: Hugging Face
  transformers' greedy decoding of the same checkpoint in float32 on the CPU
  (no TF32 anywhere; vLLM's own float32 TRITON_ATTN decode is not exact).
  On the GPU a verify step's GEMMs have other shapes than a decode step's, so
  float32 rounding differs in the last bits; a sequence may therefore leave
  the oracle only where the oracle's two best tokens are tied to 1e-3, and at
  most two of sixteen may;
  With graphs, uniform verify batches replay full CUDA graphs that hold the
  tree kernel; a prompt of exactly budget + 1 tokens checks that its prefill,
  which has the same shape, gets causal attention all the same;
- mixed steps (chunked prefill next to tree verification), same rule;
- bfloat16 (FLASH_ATTN, whose steady-state steps run FlashAttention 3 over the
  prefix and the tree kernel over the trees): the share of identical tokens, and
  every divergence starts where the reference's two best tokens are nearly tied;
- ``ddtree_topk_cap: 1`` with budget = block_size - 1 reproduces vLLM's native
  DFlash chain: same tokens, same draft and acceptance counters.
"""

from __future__ import annotations

import pytest
import torch

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    assert_scheduling_logged,
    greedy,
    prompt_ids,
    shutdown,
    spec_metrics,
)
from tests.gpu_utils import (
    BF16_NEAR_TIE,
    ENGINE_MARKS,
    FLOAT32_NEAR_TIE,
    MAX_TOKENS,
    PROMPTS16,
    assert_cap_1_is_the_native_chain,
    assert_identical_or_near_tie,
    gpu_llm,
    greedy_with_top2,
    reference_then_ddtree,
)

pytestmark = [
    *ENGINE_MARKS,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BLOCK = 8
BUDGETS = [1, 7, 8, 16, 17, 31, 64]
ASYNC_BUDGETS = [7, 16, 64]  # also run with async scheduling


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "graphs"])
def reference(request, gpu_qwen3):
    """Non-speculative greedy outputs (float32) in one compilation mode."""
    graphs = request.param
    llm = gpu_llm(gpu_qwen3, graphs=graphs)
    try:
        ids = prompt_ids(llm, PROMPTS16)
        outputs = greedy_with_top2(llm, PROMPTS16)
    finally:
        shutdown(llm)
    return graphs, dict(zip(ids, [o[0] for o in outputs])), outputs, ids


@pytest.mark.parametrize(
    "budget,async_scheduling",
    [(b, False) for b in BUDGETS] + [(b, True) for b in ASYNC_BUDGETS],
    ids=[f"{b}" for b in BUDGETS] + [f"{b}-async" for b in ASYNC_BUDGETS],
)
def test_greedy_identical_float32(
    gpu_qwen3, make_drafter, reference, hf_float32, monkeypatch, tmp_path, capfd, budget,
    async_scheduling,
):
    graphs, references, vllm_outputs, ids = reference
    expected = hf_float32(ids)
    print(f"vLLM non-speculative vs transformers ({'graphs' if graphs else 'eager'}):")
    assert_identical_or_near_tie([o[0] for o in vllm_outputs], expected, float("inf"))
    # A prompt of exactly budget + 1 tokens (sharing no cached prefix): its prefill
    # has the verify steps' uniform shape, but must not replay their full graph,
    # which holds the tree kernel and reads that step's tree masks.
    width_ids = tuple([t for i in ids for t in reversed(i)][: budget + 1])
    assert len(width_ids) == budget + 1
    (width_expected,) = hf_float32([width_ids])
    scripted_drafter.install(monkeypatch, tmp_path, {**references, width_ids: width_expected[0]})
    drafter = make_drafter(gpu_qwen3, BLOCK)
    config = {"method": "ddtree", "model": str(drafter), "ddtree_budget": budget,
              "ddtree_topk_cap": 4 if budget % 2 else None}
    llm = gpu_llm(gpu_qwen3, config, graphs=graphs, async_scheduling=async_scheduling)
    try:
        batch16 = greedy(llm, PROMPTS16, MAX_TOKENS)
        batch1 = greedy(llm, PROMPTS16[3:4], MAX_TOKENS)
        width_prefill = greedy(llm, [{"prompt_token_ids": list(width_ids)}], MAX_TOKENS)
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)
    assert_scheduling_logged(capfd, async_scheduling)
    identical = assert_identical_or_near_tie(batch16, expected, FLOAT32_NEAR_TIE)
    assert identical >= len(PROMPTS16) - 2
    assert_identical_or_near_tie(batch1, expected[3:4], FLOAT32_NEAR_TIE)
    assert_identical_or_near_tie(width_prefill, [width_expected], FLOAT32_NEAR_TIE)
    # Trees were verified and accepted beyond depth 1 (the script accepts most drafts).
    assert metrics["num_drafts"] > 0
    assert metrics["num_accepted_tokens"] > metrics["num_drafts"] * min(budget, 2) / 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_prefill_and_tree_steps(gpu_qwen3, make_drafter, monkeypatch, tmp_path, capfd,
                                      async_scheduling):
    """Long prompts prefill in 64-token chunks while the short ones already verify
    trees, so steps mix prefill rows (the parent backend's kernel) with tree rows
    (the tree kernel over gathered rows): the path a server takes when requests
    arrive while others decode."""
    prompts = [*PROMPTS, " ".join(PROMPTS) * 2, " ".join(reversed(PROMPTS)) * 3]
    config = {"method": "ddtree", "model": str(make_drafter(gpu_qwen3, BLOCK)),
              "ddtree_budget": 5, "ddtree_topk_cap": 2}
    ids, reference, got = reference_then_ddtree(
        gpu_qwen3, prompts, config, monkeypatch, tmp_path, graphs=False,
        max_num_batched_tokens=64, enable_chunked_prefill=True, enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    assert_scheduling_logged(capfd, async_scheduling)
    assert max(len(i) for i in ids) > 2 * 64  # the long prompts need several chunks
    assert assert_identical_or_near_tie(got, reference, FLOAT32_NEAR_TIE) >= len(prompts) - 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bfloat16_match_rate(gpu_qwen3, make_drafter, monkeypatch, tmp_path, capfd,
                             async_scheduling):
    """On FLASH_ATTN in bf16 the default ddtree_prefix_attention ('auto') lets
    FlashAttention 3 take the prefix and the tree kernel the trees; the engine says so
    in its log (captured from the engine process through the file descriptors)."""
    config = {"method": "ddtree", "model": str(make_drafter(gpu_qwen3, BLOCK)),
              "ddtree_budget": 16}
    _, reference, got = reference_then_ddtree(
        gpu_qwen3, PROMPTS16, config, monkeypatch, tmp_path, dtype="bfloat16", graphs=True,
        async_scheduling=async_scheduling,
    )
    log = assert_scheduling_logged(capfd, async_scheduling)
    assert "Using FLASH_ATTN attention backend" in log
    assert "DDTree tree attention: FlashAttention 3 over the prefix" in log
    expected = [r[0] for r in reference]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    total = sum(len(e) for e in expected)
    print(f"bf16 greedy match: {same}/{total} tokens")
    assert_identical_or_near_tie(got, reference, BF16_NEAR_TIE)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_topk_cap_1_is_the_native_dflash_chain(
    tiny_llama_repetitive, make_drafter, monkeypatch, async_scheduling
):
    """Cap 1 and budget = block_size - 1: the tree is DFlash's chain (both engines on
    the V1 runner, with the same scheduling)."""
    assert_cap_1_is_the_native_chain(tiny_llama_repetitive,
                                     make_drafter(tiny_llama_repetitive, BLOCK, mode="repeat"),
                                     BLOCK, async_scheduling=async_scheduling)
