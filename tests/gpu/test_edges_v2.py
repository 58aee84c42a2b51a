"""Engine edges on the GPU path (vLLM 0.33, V2 runner, torch.compile + CUDA graphs,
float32): each identical to plain greedy decoding on the same GPU, or different only
where the reference's two best tokens are a near tie (tests/gpu_utils). A KV cache so
small that requests are preempted in the middle of their trees; requests that reach
max_model_len while a tree is in flight; a long prompt prefilled in chunks next to
tree steps; prefix-cache hits; requests aborted between tree steps. The drafter is
scripted from the plain output, so trees are accepted deep and often. The CPU twins
are tests/engine/test_edges.py.
"""

from __future__ import annotations

import pytest
import torch

from tests import scripted_drafter
from tests.e2e_utils import PROMPTS, generate_with_aborts, greedy, prompt_ids, shutdown
from tests.gpu.test_e2e_v2 import _has_v2_runner
from tests.gpu_utils import (
    ENGINE_MARKS,
    FLOAT32_NEAR_TIE,
    MAX_TOKENS,
    assert_identical_or_near_tie,
    gpu_llm,
    greedy_with_top2,
)

pytestmark = [
    *ENGINE_MARKS,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not _has_v2_runner(), reason="needs vLLM 0.33 (V2 runner)"),
]

SHARED = ("You are a careful assistant. Answer in one short paragraph, plainly, and "
          "without lists. ")  # a common prefix: the prefix cache serves it
LONG = " ".join(PROMPTS) * 4  # about 340 tokens: prefilled in chunks
ALL = PROMPTS + [SHARED + p for p in PROMPTS] + [LONG]


@pytest.fixture(scope="module")
def reference(gpu_qwen3):
    """Plain greedy decoding of every prompt here, with its two best log-probabilities:
    {prompt: (token ids, top-2)} and {prompt ids: token ids} for the scripted drafter."""
    llm = gpu_llm(gpu_qwen3, graphs=True)
    try:
        ids = prompt_ids(llm, ALL)
        out = greedy_with_top2(llm, ALL)
    finally:
        shutdown(llm)
    return dict(zip(ALL, out)), dict(zip(ids, [o[0] for o in out]))


@pytest.fixture
def ddtree(gpu_qwen3, make_drafter, reference, monkeypatch, tmp_path):
    """``ddtree(**engine_kw)``: a DDTree engine (budget 16, top-k cap 4) on the V2
    runner with graphs, its drafter scripted from the reference."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    scripted_drafter.install(monkeypatch, tmp_path, reference[1])
    config = {"method": "ddtree", "model": str(make_drafter(gpu_qwen3, 8)),
              "ddtree_budget": 16, "ddtree_topk_cap": 4}
    return lambda **kw: gpu_llm(gpu_qwen3, config, graphs=True, **kw)


def _expected(reference, prompts, cut=None):
    by_prompt = reference[0]
    return [(by_prompt[p][0][:cut], by_prompt[p][1][:cut]) for p in prompts]


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def test_v2_preemption_in_the_middle_of_trees(ddtree, reference):
    # 10 blocks of 16 slots for eight requests with 17-row trees: vLLM preempts some
    # and recomputes them later.
    llm = ddtree(num_gpu_blocks_override=10, kv_cache_memory_bytes=None, max_model_len=128)
    try:
        got = greedy(llm, PROMPTS, MAX_TOKENS)
        preempted = _counter(llm, "vllm:num_preemptions")
    finally:
        shutdown(llm)
    assert_identical_or_near_tie(got, _expected(reference, PROMPTS), FLOAT32_NEAR_TIE)
    assert preempted > 0


def test_v2_max_model_len_reached_inside_a_tree(ddtree, reference):
    from vllm import SamplingParams

    lengths = {p: len(ids) for ids, p in zip(reference[1], ALL)}
    limit = max(lengths[p] for p in PROMPTS) + 6  # every prompt stops within a tree's depth
    llm = ddtree(max_model_len=limit)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        shutdown(llm)
    for prompt, out in zip(PROMPTS, outputs):
        room = limit - len(out.prompt_token_ids)
        got = list(out.outputs[0].token_ids)
        assert len(got) == room
        assert out.outputs[0].finish_reason == "length"
        assert_identical_or_near_tie([got], _expected(reference, [prompt], room),
                                     FLOAT32_NEAR_TIE)


def test_v2_long_prompt_prefilled_in_chunks_next_to_trees(ddtree, reference):
    # 256 tokens a step, 7 decoding requests of 17 rows: the long prompt's prefill
    # takes the rest of several steps while the others verify trees.
    llm = ddtree(max_num_batched_tokens=256, max_num_seqs=8, enable_chunked_prefill=True)
    try:
        got = greedy(llm, PROMPTS[:7] + [LONG], MAX_TOKENS)
    finally:
        shutdown(llm)
    assert_identical_or_near_tie(got, _expected(reference, PROMPTS[:7] + [LONG]),
                                 FLOAT32_NEAR_TIE)


def test_v2_prefix_cache_hits_next_to_trees(ddtree, reference):
    shared = [SHARED + p for p in PROMPTS]
    llm = ddtree(enable_prefix_caching=True)
    try:
        first = greedy(llm, shared[:2], MAX_TOKENS)
        rest = greedy(llm, shared, MAX_TOKENS)  # every prompt's prefix is cached now
        hits = _counter(llm, "vllm:prefix_cache_hits")
    finally:
        shutdown(llm)
    assert_identical_or_near_tie(first, _expected(reference, shared[:2]), FLOAT32_NEAR_TIE)
    assert_identical_or_near_tie(rest, _expected(reference, shared), FLOAT32_NEAR_TIE)
    assert hits > 0


def test_v2_abort_in_the_middle_of_trees(ddtree, reference):
    llm = ddtree()
    aborted = {1, 4, 6}
    try:
        done = generate_with_aborts(llm, PROMPTS, MAX_TOKENS, aborted, after_steps=3)
        after = greedy(llm, PROMPTS, MAX_TOKENS)
    finally:
        shutdown(llm)
    kept = [i for i in range(len(PROMPTS)) if i not in aborted]
    assert set(done) >= set(kept)
    assert_identical_or_near_tie([done[i] for i in kept],
                                 _expected(reference, [PROMPTS[i] for i in kept]),
                                 FLOAT32_NEAR_TIE)
    assert_identical_or_near_tie(after, _expected(reference, PROMPTS), FLOAT32_NEAR_TIE)
