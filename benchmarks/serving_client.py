"""vLLM's OpenAI server for bench_serving.py: a server process per method, its speculative
counters, and a streaming load client that needs nothing beyond the standard library
(`vllm bench serve` needs pandas and aiohttp, which the vLLM kit for the lent H200 does
not carry, and times one server at a time).

Per request the client measures what `vllm bench serve` reports: TTFT, the time from
sending the request to the first streamed event that carries a token; latency, to the
end of the stream; output tokens, from the stream's final usage (with speculative decoding
one event can carry several tokens, so events are not counted as tokens). TPOT is
(latency - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import prompt_sets


@dataclass
class Method:
    """One engine of the benchmark: a name and its speculative config."""

    name: str
    config: dict | None  # the speculative_config; None: plain decoding
    skip: str | None = None  # why it cannot run with this plugin, if it cannot
    env: dict[str, str] = field(default_factory=dict)  # set for this engine or server


# The plugin sets VLLM_USE_V2_MODEL_RUNNER in the process that starts a DDTree engine;
# every engine and server here starts from the value the run began with instead.
RUNNER_ENV = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
SERVED_NAME = "bench"


class ServerDriver:
    """bench_serving.py's serve mode: one OpenAI server per method (a subprocess in its
    own session), loaded by the streaming client below; tau per pass from the server's
    own counters."""

    mode = "serve"

    def __init__(self, target: Path, args: argparse.Namespace, prompts: dict, share: float):
        self.target, self.args, self.prompts, self.share = target, args, prompts, share
        self.logs: Path | None = None  # the servers' logs, while they run
        self.launched: dict[str, dict] = {}  # servers launched and not yet waited for

    def launch(self, methods: list[Method]) -> None:
        """Start every method's server at once where the KV cache is sized ahead
        (--kv-cache-memory-bytes): vLLM then does not profile its memory, which servers
        starting beside each other would upset (each would count the others' memory as
        its own). Otherwise nothing: each server starts when ``start`` asks for it."""
        if self.args.kv_cache_memory_bytes is None:
            return
        for method in methods:
            self.launched[method.name] = self.launch_one(method)

    def command(self, method: Method, port: int) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.target), "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", a.dtype,
               "--max-model-len", str(a.max_model_len), "--seed", "0",
               "--gpu-memory-utilization", str(self.share),
               "--tensor-parallel-size", str(a.tensor_parallel_size)]
        for flag, value in (("--kv-cache-memory-bytes", a.kv_cache_memory_bytes),
                            ("--max-num-seqs", a.max_num_seqs)):
            cmd += [flag, str(value)] if value is not None else []
        cmd += [] if a.graphs else ["--enforce-eager"]
        cmd += ["--disable-custom-all-reduce"] if a.no_custom_all_reduce else []
        cmd += ["--speculative-config", json.dumps(method.config)] if method.config else []
        return cmd

    def launch_one(self, method: Method) -> dict:
        restore_runner_env()  # the server inherits this process's environment
        self.logs = self.logs or Path(tempfile.mkdtemp(prefix="bench_serving_"))
        taken = frozenset(server["port"] for server in self.launched.values())
        return launch_server(lambda port: self.command(method, port),
                             self.logs / f"{method.name}.log", taken, method.env)

    def start(self, method: Method) -> dict:
        server = self.launched.pop(method.name, None) or self.launch_one(method)
        return wait_healthy(server, self.args.startup_timeout)

    def run(self, server: dict, key: tuple, index: int) -> tuple[float, list[dict]]:
        name, temperature, concurrency = key
        size = prompt_sets.pass_size("serve", concurrency, self.args.min_prompts,
                                     self.args.per_slot)
        bodies = [{"model": SERVED_NAME, "prompt": p.token_ids,
                   "max_tokens": self.args.max_tokens, "temperature": temperature,
                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                  for p in prompt_sets.window(self.prompts[name], size, index)]
        return asyncio.run(run_load(server["port"], bodies, concurrency))

    def prepare(self, server: dict, method: Method, keys: list[tuple]) -> list[dict]:
        for key in keys:
            self.run(server, key, 0)
        return []

    def timed(self, server: dict, method: Method, key: tuple, round_index: int) -> dict:
        before = read_counters(server["url"])
        seconds, results = self.run(server, key, round_index + 1)
        after = read_counters(server["url"])
        drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
        accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
        ok = [r for r in results if "error" not in r]
        tokens = sum(r["output_tokens"] for r in ok)
        return {"mode": self.mode, "method": method.name, "set": key[0], "temperature": key[1],
                "load": key[2], "round": round_index, "requests": len(results),
                "errors": [r["error"] for r in results if "error" in r][:3],
                "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                "req_per_s": len(ok) / seconds, "tau": 1 + accepted / drafts if drafts else None,
                "chunks_per_request": statistics.mean(r["chunks"] for r in ok) if ok else None,
                "ttft_s": [round(r["ttft"], 5) for r in ok],
                "tpot_s": [round((r["latency"] - r["ttft"]) / (r["output_tokens"] - 1), 6)
                           for r in ok if r["output_tokens"] > 1]}

    def settings(self, server: dict) -> dict:
        """The port, and the start-up time from the server's launch (for servers
        launched together, longer than the wait in ``start``)."""
        return {"port": server["port"],
                "startup_s": round(time.monotonic() - server["launched"], 1)}

    def stop(self, server: dict) -> list[str]:
        """Stop the server; returns the plugin's lines from its log (plugin_lines)."""
        lines = plugin_lines(server["log"])
        stop_server(server)
        return lines

    def close(self) -> None:
        for server in self.launched.values():  # launched, never started: a run cut short
            stop_server(server)
        self.launched.clear()
        if self.logs is not None:
            shutil.rmtree(self.logs, ignore_errors=True)


# --- the server process and its counters ------------------------------------------------


def restore_runner_env() -> None:
    """Undo what an earlier DDTree engine in this process set (see RUNNER_ENV)."""
    if RUNNER_ENV is None:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    else:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = RUNNER_ENV


def launch_server(command: Callable[[int], list[str]], log: Path,
                  taken: frozenset[int] = frozenset(), env: dict[str, str] | None = None
                  ) -> dict:
    """Start ``command(port)`` in its own session, logging to ``log``; do not wait.
    ``taken``: ports of servers launched and not yet listening, not to be handed out
    again; ``env``: variables set for the server on top of this process's."""
    port = free_port(taken)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(command(port), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
    return {"proc": proc, "url": f"http://127.0.0.1:{port}", "port": port, "log": log,
            "launched": time.monotonic()}


def wait_healthy(server: dict, timeout: float) -> dict:
    """Wait until a launched server's /health answers, at most ``timeout`` seconds from
    its launch. Raises RuntimeError with the log's tail (and stops it) when it does not."""
    proc, deadline = server["proc"], server["launched"] + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(server["url"] + "/health", timeout=5):
                return server
        except OSError:
            time.sleep(1)
    tail = "\n".join(server["log"].read_text(errors="replace").splitlines()[-30:])
    why = f"exited with code {proc.returncode}" if proc.poll() is not None else (
        f"not healthy after {timeout:.0f} s")
    stop_server(server)
    raise RuntimeError(f"the server {why}:\n{tail}")


PLUGIN_LINES = 400  # the most plugin log lines kept per server


def plugin_lines(log: Path) -> list[str]:
    """The lines a server logged from this plugin (start-up, the tree sizer's periodic
    line: sizes chosen, step times, steps timed), the last PLUGIN_LINES of them."""
    if not log.exists():
        return []
    with open(log, errors="replace") as fh:
        lines = [line.rstrip("\n") for line in fh if "DDTree" in line or "ddtree" in line]
    return lines[-PLUGIN_LINES:]


def stop_server(server: dict) -> None:
    """SIGTERM the server, SIGKILL after 30 s, then whatever its session still holds
    (its engine processes; the session is the one start_server made), and drop its log."""
    proc = server["proc"]
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
    server["log"].unlink(missing_ok=True)


def free_port(taken: frozenset[int] = frozenset()) -> int:
    """A port free now, not in ``taken``."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def read_counters(url: str) -> dict[str, float]:
    """The server's speculative counters, from its Prometheus text at /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return parse_counters(resp.read().decode())


def parse_counters(text: str) -> dict[str, float]:
    """num_drafts and num_accepted_tokens summed over label sets (Prometheus exposes a
    counter with a _total suffix, and a _created sample that is not a count)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0].removesuffix("_total")
        if name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            key = name.removeprefix("vllm:spec_decode_")
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# --- the streaming client ---------------------------------------------------------------


async def run_load(port: int, bodies: list[dict], concurrency: int,
                   host: str = "127.0.0.1") -> tuple[float, list[dict]]:
    """Every request, at most ``concurrency`` in flight; (wall seconds, per request)."""
    slots = asyncio.Semaphore(concurrency)

    async def limited(body: dict) -> dict:
        async with slots:
            return await stream_request(host, port, body)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(b) for b in bodies))
    return time.perf_counter() - start, list(results)


async def stream_request(host: str, port: int, body: dict) -> dict:
    """One streamed /v1/completions request over plain HTTP/1.1: time to the first
    event carrying a token (TTFT), to the end (latency), the usage's token count and the
    events that carried tokens. A failure comes back as {"error": ...}, never raised, so
    one bad request does not end the pass."""
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return {"error": f"connect: {exc}"}
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (host.encode(), port, len(payload), payload))
        await writer.drain()
        status = (await reader.readline()).decode(errors="replace").strip()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode(errors="replace").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        if " 200" not in status:
            return {"error": f"{status}: {(await reader.read())[:300]!r}"}
        first, tokens, chunks = None, 0, 0
        async for event in sse_events(reader, headers.get("transfer-encoding") == "chunked"):
            if event.get("choices"):
                first = first or time.perf_counter()
                chunks += 1
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        end = time.perf_counter()
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        writer.close()
    if first is None or tokens == 0:
        return {"error": "the stream carried no token or no usage"}
    return {"ttft": first - start, "latency": end - start, "output_tokens": tokens,
            "chunks": chunks}


async def sse_events(reader: asyncio.StreamReader, chunked: bool):
    """The JSON events of a server-sent-event body, up to ``data: [DONE]``."""
    buffer = b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0] or b"0", 16)
            data = await reader.readexactly(size + 2) if size else b""
            data = data[:-2]
        else:
            data = await reader.read(65536)
        if not data:
            return
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                yield json.loads(payload)
