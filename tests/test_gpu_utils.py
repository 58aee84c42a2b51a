"""tests/gpu_utils.py's per-token oracle for the bf16 GPU tests, checked on the CPU
in float32, where greedy decoding is exact: plain greedy output has no gap from the
target's best token, and a token swapped in shows one. The same with the judge reading
one token a step (ONE_TOKEN_CHUNKS, behind an anchor), whose scheduler must then give no
request more than one token a step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from tests.e2e_utils import PROMPTS, greedy, make_llm, prompt_ids, shutdown
from tests.gpu_utils import (
    ONE_TOKEN_CHUNKS,
    assert_each_token_near_greedy,
    greedy_gaps,
    greedy_one_token_chunks,
)

pytestmark = pytest.mark.slow


WIDEST_ENV = "DDTREE_TEST_WIDEST_CHUNK"
REPO = Path(__file__).resolve().parents[1]


class WidestChunkScheduler(Scheduler):
    """vLLM's scheduler, writing to the file that WIDEST_ENV names the most tokens it
    has given one request in one step (the engine's own process runs it)."""

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        path = os.environ.get(WIDEST_ENV)
        if path and out.num_scheduled_tokens:
            record = Path(path)
            widest = max(out.num_scheduled_tokens.values())
            if widest > int(record.read_text() or 0):
                record.write_text(str(widest))
        return out


@pytest.mark.parametrize("one_token_chunks", [False, True], ids=["prefill", "one-token"])
def test_greedy_gaps_are_zero_for_greedy_output_and_show_a_swapped_token(
        tiny_qwen3, monkeypatch, tmp_path, one_token_chunks):
    record = tmp_path / "widest"
    record.write_text("0")
    monkeypatch.setenv(WIDEST_ENV, str(record))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    llm = make_llm(str(tiny_qwen3), scheduler_cls=f"{__name__}.WidestChunkScheduler",
                   **(ONE_TOKEN_CHUNKS if one_token_chunks else {}))
    try:
        ids = prompt_ids(llm, PROMPTS)
        outputs = (greedy_one_token_chunks(llm, ids, 12) if one_token_chunks
                   else greedy(llm, PROMPTS, 12))
        record.write_text("0")
        gaps = greedy_gaps(llm, ids, outputs, one_token_chunks=one_token_chunks)
        widest = int(record.read_text())
        assert_each_token_near_greedy(gaps, 1e-4)
        swapped = [list(o) for o in outputs]
        # Any other token, last (the greedy tokens after it no longer follow their prefix).
        swapped[1] = [*swapped[1][:5], (swapped[1][5] + 1) % 64]
        bad = greedy_gaps(llm, ids, swapped, one_token_chunks=one_token_chunks)
    finally:
        shutdown(llm)
    # The judge read its sequences one token a step, or (a prefill) many at once.
    assert (widest == 1) == one_token_chunks, widest
    assert [len(row) for row in gaps] == [12] * len(PROMPTS)
    assert max(bad[1][:5]) <= 1e-4 and len(bad[1]) == 6 and bad[1][5] > 1e-3
    assert bad[0] == pytest.approx(gaps[0], abs=1e-5)
    with pytest.raises(AssertionError, match="sequence 1, token 5"):
        assert_each_token_near_greedy(bad, 1e-3)
