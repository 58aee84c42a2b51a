"""tests/gpu_utils.py's per-token oracle for the bf16 GPU tests, checked on the CPU
in float32, where greedy decoding is exact: plain greedy output has no gap from the
target's best token, and a token swapped in shows one."""

from __future__ import annotations

import pytest

from tests.e2e_utils import PROMPTS, greedy, make_llm, prompt_ids, shutdown
from tests.gpu_utils import assert_each_token_near_greedy, greedy_gaps

pytestmark = pytest.mark.slow


def test_greedy_gaps_are_zero_for_greedy_output_and_show_a_swapped_token(tiny_qwen3):
    llm = make_llm(str(tiny_qwen3))
    try:
        ids = prompt_ids(llm, PROMPTS)
        outputs = greedy(llm, PROMPTS, 12)
        gaps = greedy_gaps(llm, ids, outputs)
        assert_each_token_near_greedy(gaps, 1e-4)
        swapped = [list(o) for o in outputs]
        # Any other token, last (the greedy tokens after it no longer follow their prefix).
        swapped[1] = [*swapped[1][:5], (swapped[1][5] + 1) % 64]
        bad = greedy_gaps(llm, ids, swapped)
    finally:
        shutdown(llm)
    assert [len(row) for row in gaps] == [12] * len(PROMPTS)
    assert max(bad[1][:5]) <= 1e-4 and len(bad[1]) == 6 and bad[1][5] > 1e-3
    assert bad[0] == pytest.approx(gaps[0], abs=1e-5)
    with pytest.raises(AssertionError, match="sequence 1, token 5"):
        assert_each_token_near_greedy(bad, 1e-3)
