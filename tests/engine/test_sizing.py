"""Trees sized per step through real vLLM (float32, CPU): vLLM's batch-size schedule
and ddtree_adaptive verify smaller trees than the budget, losslessly, and a smaller
size verifies the best tree of that size (exact acceptance against the simulation of
a build at that budget)."""

from __future__ import annotations

import pytest
import torch

from tests import scripted_drafter
from tests.e2e_utils import (
    PROMPTS,
    greedy,
    keep_async_scheduling,
    make_llm,
    plain_reference,
    shutdown,
    spec_metrics,
)
from tests.engine.test_acceptance import MAX_TOKENS, simulate
from vllm_ddtree.ops.tree import build_ddtree

pytestmark = pytest.mark.slow

BLOCK, BUDGET, CAP = 8, 16, 4


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return plain_reference(tiny_llama, PROMPTS, MAX_TOKENS + 20)


def run(tiny_llama, make_drafter, reference, monkeypatch, tmp_path, rule="mixed",
        async_scheduling=False, **keys):
    ids, outputs = reference
    scripted_drafter.install(monkeypatch, tmp_path, dict(zip(ids, outputs)), rule)
    config = {"method": "ddtree", "model": str(make_drafter(tiny_llama, BLOCK)),
              "ddtree_budget": BUDGET, "ddtree_topk_cap": CAP, **keys}
    if async_scheduling:
        keep_async_scheduling(monkeypatch)
    llm = make_llm(str(tiny_llama), config, async_scheduling=async_scheduling or None)
    try:
        got = greedy(llm, PROMPTS, MAX_TOKENS)
        metrics = spec_metrics(llm)
    finally:
        shutdown(llm)
    assert got == [out[:MAX_TOKENS] for out in outputs]
    return metrics


def test_a_smaller_size_verifies_the_best_tree_of_that_size(
        tiny_llama, make_drafter, reference, monkeypatch, tmp_path):
    # Budget 16 with 5 drafts scheduled at every batch size: the trees verified must
    # be builds of budget 5, not the first 5 nodes of the budget-16 tree (its greedy
    # chain). A flat scripted drafter makes the two differ.
    monkeypatch.setenv(scripted_drafter.RANK_STEP_ENV, "0.5")
    ids, outputs = reference
    rule = scripted_drafter.RULES["siblings"]
    true = list(range(10, 80, 10))
    differ = 0
    for position in range(8):
        lp = scripted_drafter.scripted_logprobs(true, lambda d: rule(position, d), 1024)[None]
        full = build_ddtree(lp, torch.tensor([1]), BUDGET, CAP)
        differ += not torch.equal(full.tokens[:, :6], build_ddtree(lp, torch.tensor([1]), 5,
                                                                   CAP).tokens)
    assert differ >= 4
    steps = [step for prompt, out in zip(ids, outputs)
             for step in simulate(list(prompt) + out, len(prompt), BLOCK, 5, CAP, rule)]
    metrics = run(tiny_llama, make_drafter, reference, monkeypatch, tmp_path, "siblings",
                  num_speculative_tokens_per_batch_size=[[1, 64, 5]])
    accepted = [a for a, _ in steps]
    assert any(rank > 0 for a, rank in steps if a > 0)  # through second siblings
    assert metrics["num_drafts"] == len(steps)
    assert metrics["num_draft_tokens"] == 5 * len(steps)
    assert metrics["num_accepted_tokens"] == sum(accepted)
    per_pos = [sum(a > j for a in accepted) for j in range(5)]
    assert list(metrics["num_accepted_tokens_per_pos"])[:5] == per_pos


def test_sizes_by_batch_size_are_lossless(tiny_llama, make_drafter, reference, monkeypatch,
                                          tmp_path):
    # 8 requests verify 3 drafts each until the first of them ends, then 16.
    metrics = run(tiny_llama, make_drafter, reference, monkeypatch, tmp_path,
                  num_speculative_tokens_per_batch_size=[[1, 7, 16], [8, 64, 3]])
    drafts, tokens = metrics["num_drafts"], metrics["num_draft_tokens"]
    big = (tokens - 3 * drafts) / 13  # drafts of 16 tokens; the rest had 3
    assert big == int(big) and 0 < big < drafts, (drafts, tokens)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adaptive_sizes_are_lossless(tiny_llama, make_drafter, reference, monkeypatch,
                                     tmp_path, capfd, async_scheduling):
    metrics = run(tiny_llama, make_drafter, reference, monkeypatch, tmp_path,
                  async_scheduling=async_scheduling, ddtree_adaptive=True)
    # Every size was tried: fewer draft tokens than budget-16 steps would have sent.
    assert 0 < metrics["num_draft_tokens"] < BUDGET * metrics["num_drafts"]
    logged = capfd.readouterr()
    assert "tree size chosen per step" in logged.out + logged.err
