"""The drafter ``python -m training`` trained on the tiny target, in vLLM on the CPU
(float32, eager): vLLM's native "dflash" and DDTree load it, and greedy output equals
plain decoding token for token. One engine at a time."""

from __future__ import annotations

import pytest

from tests.e2e_utils import PROMPTS, greedy, make_llm, shutdown, spec_metrics

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
ENGINE = {"kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def plain(tiny_target):
    llm = make_llm(str(tiny_target), **ENGINE)
    try:
        return greedy(llm, PROMPTS, MAX_TOKENS)
    finally:
        shutdown(llm)


@pytest.mark.parametrize("spec", [
    {"method": "dflash", "num_speculative_tokens": 3},  # block size 4: 3 drafts
    {"method": "ddtree", "ddtree_budget": 5, "ddtree_topk_cap": 2},
], ids=["dflash", "ddtree"])
def test_trained_drafter_greedy_equals_plain_decoding(tiny_target, tiny_run, plain, spec):
    llm = make_llm(str(tiny_target), {**spec, "model": str(tiny_run[0] / "drafter")}, **ENGINE)
    try:
        got = greedy(llm, PROMPTS, MAX_TOKENS)
        drafts = spec_metrics(llm).get("num_drafts") or 0
    finally:
        shutdown(llm)
    assert drafts > 0  # the drafter ran
    assert got == plain
