"""tests/gpu_utils.py's per-token oracle for the bf16 GPU tests, checked on the CPU
in float32, where greedy decoding is exact: plain greedy output has no gap from the
target's best token, and a token swapped in shows one. The same with the judge reading
one token a step (ONE_TOKEN_CHUNKS, behind an anchor), whose scheduler must then give no
request more than one token a step."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from tests.e2e_utils import PROMPTS, greedy, make_llm, prompt_ids, shutdown
from tests.gpu_utils import (
    ONE_TOKEN_CHUNKS,
    assert_each_token_near_greedy,
    greedy_gaps,
    greedy_one_token_chunks,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("one_token_chunks", [False, True], ids=["prefill", "one-token"])
def test_greedy_gaps_are_zero_for_greedy_output_and_show_a_swapped_token(
        tiny_qwen3, monkeypatch, one_token_chunks):
    # The engine core in this process, so the test sees what its scheduler schedules.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = make_llm(str(tiny_qwen3), **(ONE_TOKEN_CHUNKS if one_token_chunks else {}))
    try:
        ids = prompt_ids(llm, PROMPTS)
        outputs = (greedy_one_token_chunks(llm, ids, 12) if one_token_chunks
                   else greedy(llm, PROMPTS, 12))
        with widest_chunk(llm) as widest:
            gaps = greedy_gaps(llm, ids, outputs, one_token_chunks=one_token_chunks)
        assert_each_token_near_greedy(gaps, 1e-4)
        swapped = [list(o) for o in outputs]
        # Any other token, last (the greedy tokens after it no longer follow their prefix).
        swapped[1] = [*swapped[1][:5], (swapped[1][5] + 1) % 64]
        bad = greedy_gaps(llm, ids, swapped, one_token_chunks=one_token_chunks)
    finally:
        shutdown(llm)
    # The judge read its sequences one token a step, or (a prefill) many at once.
    assert (widest[0] == 1) == one_token_chunks, widest
    assert [len(row) for row in gaps] == [12] * len(PROMPTS)
    assert max(bad[1][:5]) <= 1e-4 and len(bad[1]) == 6 and bad[1][5] > 1e-3
    assert bad[0] == pytest.approx(gaps[0], abs=1e-5)
    with pytest.raises(AssertionError, match="sequence 1, token 5"):
        assert_each_token_near_greedy(bad, 1e-3)


@contextmanager
def widest_chunk(llm):
    """Inside the block, the most tokens the scheduler gave one request in one step
    (``[n]``); needs the engine core in this process."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, widest = scheduler.schedule, [0]

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        widest[0] = max(widest[0], *out.num_scheduled_tokens.values(), 0)
        return out

    scheduler.schedule = recording
    try:
        yield widest
    finally:
        scheduler.schedule = schedule
