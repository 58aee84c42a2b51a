"""Greedy DDTree through real vLLM equals non-speculative decoding (float32).

Every (budget, block size, top-k cap) combination below runs a batch of 8
prompts of different lengths. The drafter is scripted from the reference run
(tests/scripted_drafter.py) so that drafts are accepted at many depths and
sibling ranks, partially and fully; a wrong position, mask, slot move or walk
changes the text. Budgets cover < block_size - 1, = block_size - 1,
= block_size, > block_size and odd values, including block 8 with budget 16.
"""

from __future__ import annotations

import pytest

from tests import scripted_drafter
from tests.e2e_utils import PROMPTS, greedy, make_llm, prompt_ids, shutdown

pytestmark = pytest.mark.slow

MAX_TOKENS = 24

CASES = [
    # (block_size, budget, topk_cap)
    *[(8, b, 4) for b in (1, 3, 7, 8, 15, 16, 17, 31)],
    *[(4, b, None) for b in (1, 3, 8)],
    *[(16, b, 2) for b in (7, 16, 31)],
    (8, 16, 1),
    (8, 16, 2),
    (8, 16, None),
]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    llm = make_llm(str(tiny_llama))
    ids = prompt_ids(llm, PROMPTS)
    outputs = greedy(llm, PROMPTS, MAX_TOKENS)
    shutdown(llm)
    return dict(zip(ids, outputs)), outputs


@pytest.fixture(scope="module")
def qwen3_reference(tiny_qwen3):
    llm = make_llm(str(tiny_qwen3))
    ids = prompt_ids(llm, PROMPTS)
    outputs = greedy(llm, PROMPTS, MAX_TOKENS)
    shutdown(llm)
    return dict(zip(ids, outputs)), outputs


def _run_ddtree(target, drafter, budget, cap, references, monkeypatch, tmp_path):
    scripted_drafter.install(monkeypatch, tmp_path, references)
    config = {
        "method": "ddtree",
        "model": str(drafter),
        "ddtree_budget": budget,
        "ddtree_topk_cap": cap,
    }
    llm = make_llm(str(target), config)
    try:
        return greedy(llm, PROMPTS, MAX_TOKENS)
    finally:
        shutdown(llm)


@pytest.mark.parametrize("block_size,budget,cap", CASES)
def test_llama_greedy_identical(
    tiny_llama, make_drafter, llama_reference, monkeypatch, tmp_path, block_size, budget,
    cap,
):
    references, expected = llama_reference
    drafter = make_drafter(tiny_llama, block_size)
    got = _run_ddtree(tiny_llama, drafter, budget, cap, references, monkeypatch, tmp_path)
    assert got == expected


@pytest.mark.parametrize("block_size,budget,cap", [(8, 16, None), (16, 5, 3)])
def test_qwen3_greedy_identical(
    tiny_qwen3, make_drafter, qwen3_reference, monkeypatch, tmp_path, block_size, budget,
    cap,
):
    references, expected = qwen3_reference
    drafter = make_drafter(tiny_qwen3, block_size)
    got = _run_ddtree(tiny_qwen3, drafter, budget, cap, references, monkeypatch, tmp_path)
    assert got == expected


def test_unscripted_drafter_greedy_identical(tiny_llama, make_drafter, llama_reference):
    """The real (random) DFlash drafter's own trees: nothing scripted."""
    _, expected = llama_reference
    drafter = make_drafter(tiny_llama, 8)
    config = {"method": "ddtree", "model": str(drafter), "ddtree_budget": 16}
    llm = make_llm(str(tiny_llama), config)
    try:
        assert greedy(llm, PROMPTS, MAX_TOKENS) == expected
    finally:
        shutdown(llm)
