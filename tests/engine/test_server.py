"""DDTree behind vLLM's OpenAI-compatible server equals offline greedy decoding.

One server per module, started as a subprocess with
``--speculative-config '{"method": "ddtree", ...}'`` exactly as a user would.
Greedy /v1/completions, /v1/chat/completions and their streaming forms must
return the text of a non-speculative offline engine. The drafter is random
(drafts are rejected): this test is about the server path, not acceptance.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_utils import make_llm, shutdown

pytestmark = pytest.mark.slow

BUDGET, TOPK_CAP, BLOCK = 8, 2, 8
MAX_TOKENS = 16
MAX_MODEL_LEN = 256
STARTUP_TIMEOUT_S = 180
PROMPTS = ["def foo(x): return x * 3", "Beautiful is better than ugly."]
MESSAGES = [{"role": "user", "content": "Explicit is better than implicit."}]
MODEL_NAME = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log_file: Path, lines: int = 60) -> str:
    return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server, SIGKILL it after 30 s, then any engine child it left
    (the server was started in its own process group, whose id is its pid)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def server_process(tiny_llama, make_drafter, tmp_path_factory):
    """The server, starting in the background (health is awaited in base_url)."""
    drafter = make_drafter(tiny_llama, BLOCK)
    spec = {
        "method": "ddtree",
        "model": str(drafter),
        "ddtree_budget": BUDGET,
        "ddtree_topk_cap": TOPK_CAP,
    }
    port = _free_port()
    log_file = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_llama),
        "--served-model-name", MODEL_NAME,
        "--dtype", "float32",
        "--enforce-eager",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--gpu-memory-utilization", "0.25",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--speculative-config", json.dumps(spec),
    ]  # fmt: skip
    # The checks read vLLM's INFO lines: a level left by another test must not hide them.
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "INFO"}
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield proc, f"http://127.0.0.1:{port}", log_file, drafter
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, Any]:
    """Offline non-speculative greedy texts, computed while the server boots."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = make_llm(str(tiny_llama), max_model_len=MAX_MODEL_LEN)
    try:
        completions = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        chat = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0].text
    finally:
        shutdown(llm)
    return {"completions": completions, "chat": chat}


@pytest.fixture(scope="module")
def base_url(server_process, reference) -> str:
    proc, url, log_file, _ = server_process
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"server exited with code {proc.returncode}:\n{_log_tail(log_file)}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{_log_tail(log_file)}")


def _post(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    with urllib.request.urlopen(_post(url, body), timeout=60) as resp:
        return json.load(resp)


def post_stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to ``data: [DONE]``."""
    events = []
    with urllib.request.urlopen(_post(url, {**body, "stream": True}), timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                return events
            events.append(json.loads(data))
    raise AssertionError(f"stream ended without [DONE] after {len(events)} events")


def _greedy(**body: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": MAX_TOKENS, **body}


def test_completions(base_url, reference):
    out = post_json(base_url + "/v1/completions", _greedy(prompt=PROMPTS))
    texts = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert texts == reference["completions"]
    assert all(t for t in texts)


def test_completions_stream(base_url, reference):
    events = post_stream(base_url + "/v1/completions", _greedy(prompt=PROMPTS))
    texts = [""] * len(PROMPTS)
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == reference["completions"]


def test_chat_completions(base_url, reference):
    out = post_json(base_url + "/v1/chat/completions", _greedy(messages=MESSAGES))
    assert out["choices"][0]["message"]["content"] == reference["chat"]
    assert reference["chat"]


def test_chat_completions_stream(base_url, reference):
    events = post_stream(base_url + "/v1/chat/completions", _greedy(messages=MESSAGES))
    text = "".join(
        choice["delta"].get("content") or "" for e in events for choice in e["choices"]
    )
    assert text == reference["chat"]


def test_server_ran_ddtree(base_url, server_process):
    # After the requests above: they must have gone through the drafter.
    _, _, log_file, drafter = server_process
    log = log_file.read_text(errors="replace")
    assert (
        f"speculative_config=DDTreeSpeculativeConfig(method='ddtree', model='{drafter}', "
        f"ddtree_budget={BUDGET}, ddtree_topk_cap={TOPK_CAP}, block_size={BLOCK})"
    ) in log
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    drafts = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_drafts_total")
    )
    assert drafts > 0, "no speculative drafts were recorded"


def scrape(base_url: str) -> dict[str, float]:
    """The server's metrics, each sample's name and labels as written, summed over
    engines."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0] + "".join(
                f"{{{part}}}" for part in name[:-1].split("{")[1].split(",")
                if part.startswith("depth=")) if "{" in name else name
            out[key] = out.get(key, 0.0) + float(value)
    return out


def test_ddtree_metrics_read_as_a_tree(base_url, server_process):
    # vllm_ddtree.metrics, loaded by vLLM as a stat-logger plugin: the same counts as
    # vLLM's spec-decode counters, per depth only down to the tree's deepest level.
    m = scrape(base_url)
    assert m["ddtree:verify_steps_total"] == m["vllm:spec_decode_num_drafts_total"] > 0
    assert m["ddtree:tree_nodes_total"] == m["vllm:spec_decode_num_draft_tokens_total"]
    assert m["ddtree:accepted_tokens_total"] == m["vllm:spec_decode_num_accepted_tokens_total"]
    depths = sorted(k for k in m if k.startswith("ddtree:accepted_tokens_per_depth_total"))
    assert depths == [f'ddtree:accepted_tokens_per_depth_total{{depth="{d}"}}'
                      for d in range(1, BLOCK)]
    assert sum(m[k] for k in depths) == m["ddtree:accepted_tokens_total"]
    assert m["ddtree:tree_size_count"] > 0
    assert m["ddtree:tree_size_sum"] / m["ddtree:tree_size_count"] <= BUDGET


def test_server_logs_ddtree_summary(base_url, server_process):
    _, _, log_file, _ = server_process
    log = log_file.read_text(errors="replace")
    assert f"DDTree: budget {BUDGET} (verify width {BUDGET + 1}), drafter block size {BLOCK}" in log
