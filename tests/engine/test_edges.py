"""Engine edges through real vLLM (float32, CPU, the V1 runner): each identical to plain
greedy decoding. A KV cache so small that requests are preempted and recomputed in the
middle of their trees; requests that reach max_model_len while a tree is in flight;
prompts that hit the prefix cache. The drafter is scripted from the plain output, so
trees are accepted deep and often (tests/scripted_drafter.py)."""

from __future__ import annotations

import pytest

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    generate_with_aborts,
    greedy,
    make_llm,
    prompt_ids,
    shutdown,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
SHARED = ("You are a careful assistant. Answer in one short paragraph, plainly, and "
          "without lists. ")  # a common prefix: the prefix cache serves it


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = make_llm(str(tiny_llama))
    prompts = PROMPTS + [SHARED + p for p in PROMPTS]
    ids = prompt_ids(llm, prompts)
    outputs = greedy(llm, prompts, MAX_TOKENS)
    shutdown(llm)
    return dict(zip(ids, outputs)), dict(zip(prompts, outputs))


def ddtree(tiny_llama, make_drafter, references, monkeypatch, tmp_path, **kw):
    scripted_drafter.install(monkeypatch, tmp_path, references)
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, 8)),
              "ddtree_budget": 16, "ddtree_topk_cap": 4}
    return make_llm(str(tiny_llama), config, **kw)


def counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def test_preemption_in_the_middle_of_trees(tiny_llama, make_drafter, reference, monkeypatch,
                                           tmp_path):
    by_ids, by_prompt = reference
    # 12 blocks of 16 slots: eight requests of ~60 tokens plus a 17-row tree each
    # cannot all stay; vLLM preempts some and recomputes them later.
    llm = ddtree(tiny_llama, make_drafter, by_ids, monkeypatch, tmp_path,
                 num_gpu_blocks_override=12, block_size=16, max_model_len=128)
    try:
        got = greedy(llm, PROMPTS, MAX_TOKENS)
        preempted = counter(llm, "vllm:num_preemptions")
    finally:
        shutdown(llm)
    assert got == [by_prompt[p] for p in PROMPTS]
    assert preempted > 0


def test_max_model_len_reached_inside_a_tree(tiny_llama, make_drafter, reference, monkeypatch,
                                             tmp_path):
    from vllm import SamplingParams

    by_ids, by_prompt = reference
    limit = 40  # below prompt + MAX_TOKENS for every prompt: each stops at the limit
    llm = ddtree(tiny_llama, make_drafter, by_ids, monkeypatch, tmp_path,
                 max_model_len=limit)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        shutdown(llm)
    for prompt, out in zip(PROMPTS, outputs):
        room = limit - len(out.prompt_token_ids)
        assert list(out.outputs[0].token_ids) == by_prompt[prompt][:room]
        assert out.outputs[0].finish_reason == "length"


def test_prefix_cache_hits_next_to_trees(tiny_llama, make_drafter, reference, monkeypatch,
                                         tmp_path):
    by_ids, by_prompt = reference
    shared = [SHARED + p for p in PROMPTS]
    llm = ddtree(tiny_llama, make_drafter, by_ids, monkeypatch, tmp_path,
                 enable_prefix_caching=True, block_size=16)  # whole blocks are cached
    try:
        first = greedy(llm, shared[:2], MAX_TOKENS)
        rest = greedy(llm, shared, MAX_TOKENS)  # every prompt's prefix is cached now
        hits = counter(llm, "vllm:prefix_cache_hits")
    finally:
        shutdown(llm)
    assert first == [by_prompt[p] for p in shared[:2]]
    assert rest == [by_prompt[p] for p in shared]
    assert hits > 0


def test_abort_in_the_middle_of_trees(tiny_llama, make_drafter, reference, monkeypatch,
                                      tmp_path):
    """Requests aborted while their trees are in flight free their slots; the others
    and the next requests are plain decoding's."""
    by_ids, by_prompt = reference
    llm = ddtree(tiny_llama, make_drafter, by_ids, monkeypatch, tmp_path)
    try:
        aborted = {1, 4, 6}
        done = generate_with_aborts(llm, PROMPTS, MAX_TOKENS, aborted, after_steps=3)
        after = greedy(llm, PROMPTS, MAX_TOKENS)
    finally:
        shutdown(llm)
    kept = [i for i in range(len(PROMPTS)) if i not in aborted]
    assert set(done) >= set(kept)
    for i in kept:
        assert done[i] == by_prompt[PROMPTS[i]]
    for i in aborted & set(done):  # finished before the abort came: a shorter output
        assert done[i] == by_prompt[PROMPTS[i]][: len(done[i])]
    assert after == [by_prompt[p] for p in PROMPTS]
