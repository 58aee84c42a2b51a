"""Soak vLLM's OpenAI server: many mixed requests at a fixed concurrency, then check that
every request came back and that the server is idle and healthy afterwards.

The requests are /v1/completions calls, a reproducible mix (``--seed``): prompt and output
lengths drawn across ``--prompt-len`` and ``--output-len`` (tokens, about: prompts are
text), T=0 and T=0.8 (half of those seeded), stop strings, logprobs, EOS ignored or not,
streamed or not, about 10% streams closed by the client after a few events (a client
that goes away: the server must abort the request) and a few structured outputs (a
choice, a JSON schema). Per concurrency level the script reports errors (any answer but
200, a broken stream), lost requests (no answer, or a stream that ended without
``[DONE]``), p50/p99 latency, output tokens/s and vLLM's tokens per verify step
(``1 + accepted / drafts``); afterwards it waits for the server to go idle and checks
that its KV-cache usage gauge is back to zero and that /health answers 200. With a
reference (``--reference-url``, or ``--reference`` to start a plain server with the same
arguments once the soak is done) it replays every completed T=0 and seeded request there
and compares the texts.

The completed T=0 and seeded requests and their texts go to ``<out>.texts.json`` as each
level ends, so the comparison can also run later, on its own (``--replay`` with the soak's
JSON: a plain server started with ``--serve`` or given by ``--reference-url``), when one
run may not hold both servers' start-up (a device call of 10 minutes).

``--long-requests N`` adds a last phase on the same engine: N greedy requests of
``--long-tokens`` tokens each (EOS ignored), one at a time, so the engine runs many
consecutive decode steps; they are compared with the reference like the T=0 requests.
Each level reports the engine steps it took (the count of vLLM's per-iteration token
histogram), and ``--min-engine-steps`` fails a run whose engine stepped fewer times.

    # against running servers
    python benchmarks/soak_server.py --url http://127.0.0.1:8000 --model smollm2 \\
        --reference-url http://127.0.0.1:8001 --requests 2000 --concurrency 8,32,64
    # or the script starts them (one at a time): --serve TARGET, the server's own flags
    # after --server-args
    python benchmarks/soak_server.py --serve TARGET --speculative-config '{...}' \\
        --reference --requests 200 --concurrency 8 --server-args --dtype float32
    # or in two runs: the soak, then the plain server's replay of its texts
    python benchmarks/soak_server.py --serve TARGET --speculative-config '{...}' \\
        --out soak.json --server-args --dtype float32
    python benchmarks/soak_server.py --replay soak.json --serve TARGET \\
        --out soak.json --server-args --dtype float32

Writes ``--out`` (JSON, default benchmarks/results/soak.json) and prints a table. Exit
status 1 when any level had an error, a lost request, KV usage left, an unhealthy server
a T=0 text that differs from the reference (unless ``--mismatch-ok``: bf16 is not
token-exact) or fewer engine steps than ``--min-engine-steps``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Prompts are cut from this text, cycled; about 0.75 words per token.
TEXT = (
    "The river runs past the old mill and under three stone bridges before it reaches "
    "the sea. Every morning the baker opens her shop at six, and the first customers are "
    "the fishermen coming back from the harbour. Write a short function that returns the "
    "sum of the squares of a list of numbers, and explain how it works. In 1869 the canal "
    "opened, and the journey from London to Bombay became shorter by thousands of miles. "
    "A good proof begins with the definitions, states what is to be shown, and then moves "
    "one small step at a time. The committee met on Tuesday to discuss the budget, the new "
    "library and the repairs to the school roof. Photosynthesis turns light, water and "
    "carbon dioxide into sugar and oxygen inside the leaves of green plants. She opened "
    "the letter slowly, read it twice, and then put it in the drawer without a word. To "
    "sort a list, compare neighbouring items and swap them when they are out of order; "
    "repeat until nothing moves. The train to the north leaves from platform four at "
    "twenty past nine and stops at every station after the junction. "
).split()
CHOICES = ["yes", "no", "maybe"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
          "required": ["answer"]}


# --- the workload --------------------------------------------------------------------


def make_requests(n: int, seed: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  structured: bool) -> list[dict]:
    """``n`` request specs: the /v1/completions body (without the model), whether it
    streams, after how many events the client closes it (None: never) and its tags."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        tokens_in = _log_uniform(rng, *prompt_len)
        start = rng.randrange(len(TEXT))
        words = [TEXT[(start + j) % len(TEXT)] for j in range(max(1, int(tokens_in * 0.75)))]
        body: dict = {"prompt": " ".join(words), "max_tokens": _log_uniform(rng, *output_len)}
        tags = []
        if rng.random() < 0.5:
            body["temperature"] = 0.0
            tags.append("t0")
        else:
            body["temperature"] = 0.8
            tags.append("sampled")
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(2**31)
                tags.append("seeded")
        if rng.random() < 0.15:
            body["stop"] = [". ", "\n\n"]
            body["include_stop_str_in_output"] = rng.random() < 0.5
            tags.append("stop")
        if rng.random() < 0.15:
            body["logprobs"] = 2
            tags.append("logprobs")
        if rng.random() < 0.5:
            body["ignore_eos"] = True
        if structured and rng.random() < 0.03:
            body["structured_outputs"] = ({"choice": CHOICES} if rng.random() < 0.5
                                          else {"json": SCHEMA})
            body["max_tokens"] = max(body["max_tokens"], 16)
            tags.append("structured")
        stream = rng.random() < 0.4
        cancel_after = None
        if rng.random() < 0.1:  # a client that leaves mid-stream
            stream, cancel_after = True, rng.randint(1, 4)
            body["max_tokens"] = max(body["max_tokens"], 8)
            tags.append("cancel")
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        specs.append({"index": i, "body": body, "stream": stream,
                      "cancel_after": cancel_after, "tags": tags})
    return specs


def make_long_requests(n: int, tokens: int) -> list[dict]:
    """``n`` greedy requests of ``tokens`` output tokens each (EOS ignored), short prompts
    from different places in the text; indices after the mixed levels' (10**6 + i)."""
    step = max(1, len(TEXT) // max(1, n))
    specs = []
    for i in range(n):
        words = [TEXT[(i * step + j) % len(TEXT)] for j in range(48)]
        specs.append({"index": 10**6 + i, "stream": False, "cancel_after": None,
                      "tags": ["t0", "long"],
                      "body": {"prompt": " ".join(words), "max_tokens": tokens,
                               "temperature": 0.0, "ignore_eos": True}})
    return specs


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high], log-uniform: as many short as long ones."""
    if low >= high:
        return low
    return min(high, int(low * (high / low) ** rng.random()))


# --- one request ---------------------------------------------------------------------


def send(url: str, model: str, spec: dict, timeout: float) -> dict:
    """Send one request; never raises. status: ok, cancelled (closed by us on purpose),
    error (an HTTP error or a broken answer) or lost (no final answer)."""
    body = dict(spec["body"], model=model)
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    result = {"index": spec["index"], "tags": spec["tags"]}
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            if spec["stream"]:
                result.update(_read_stream(resp, spec["cancel_after"], start))
            else:
                answer = json.loads(resp.read())
                choice = answer["choices"][0]
                result.update(status="ok", text=choice["text"],
                              finish_reason=choice.get("finish_reason"),
                              tokens=answer["usage"]["completion_tokens"])
    except urllib.error.HTTPError as err:
        result.update(status="error", error=f"HTTP {err.code}: {err.read()[:300]!r}")
    except TimeoutError as err:
        result.update(status="lost", error=f"timeout: {err}")
    except (OSError, ValueError, KeyError, IndexError) as err:
        result.update(status="error", error=f"{type(err).__name__}: {err}")
    result["latency"] = time.perf_counter() - start
    return result


def _read_stream(resp, cancel_after: int | None, start: float) -> dict:
    """Read server-sent events to [DONE], or close after ``cancel_after`` events."""
    text, tokens, events, first, finish = [], 0, 0, None, None
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return {"status": "ok", "text": "".join(text), "tokens": tokens, "ttft": first,
                    "finish_reason": finish}
        event = json.loads(data)
        if "error" in event:
            return {"status": "error", "error": str(event["error"])[:300]}
        for choice in event.get("choices") or []:
            first = first if first is not None else time.perf_counter() - start
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
            events += 1
        tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        if cancel_after is not None and events >= cancel_after:
            resp.close()  # the client goes away; the server must abort the request
            return {"status": "cancelled", "tokens": 0}
    if cancel_after is not None and finish is not None:
        return {"status": "cancelled", "tokens": tokens}  # finished before we left
    return {"status": "lost", "error": "the stream ended without [DONE]"}


# --- the server ----------------------------------------------------------------------


def start_server(model_path: str, name: str, extra: list[str], log: Path,
                 timeout: float) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server in a session of its own, logging to ``log``; waits for
    /health. Returns (process, url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host",
               "127.0.0.1", "--port", str(port), "--model", model_path,
               "--served-model-name", name, *extra]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if health(url) == 200:
            return proc, url
        time.sleep(2)
    stop_server(proc)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    raise RuntimeError(f"the server did not come up ({' '.join(command)}):\n{tail}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's session, SIGKILL what is left after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def read_metrics(url: str) -> dict[str, float]:
    """The gauges and counters the soak reads, from /metrics (summed over labels)."""
    wanted = {"vllm:kv_cache_usage_perc", "vllm:num_requests_running",
              "vllm:num_requests_waiting", "vllm:spec_decode_num_drafts",
              "vllm:spec_decode_num_accepted_tokens",
              # one observation per engine iteration: its count is the engine's steps
              "vllm:iteration_tokens_total_count"}
    out: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0].removesuffix("_total")
            if name in wanted and not line.startswith("#"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits (aborts take a moment to land)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(url)
        idle = (metrics.get("vllm:num_requests_running", 0) == 0
                and metrics.get("vllm:num_requests_waiting", 0) == 0
                and metrics.get("vllm:kv_cache_usage_perc", 0) == 0)
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(1)


# --- a soak level and the reference check --------------------------------------------


def soak(url: str, model: str, specs: list[dict], concurrency: int, timeout: float,
         idle_timeout: float) -> tuple[dict, list[dict]]:
    """Every spec at ``concurrency`` in flight; (summary, per-request results)."""
    before = read_metrics(url)
    done = [0]
    lock = threading.Lock()

    def one(spec: dict) -> dict:
        result = send(url, model, spec, timeout)
        with lock:
            done[0] += 1
            if done[0] % max(1, len(specs) // 10) == 0:
                print(f"  {done[0]}/{len(specs)} at concurrency {concurrency}", flush=True)
        return result

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, specs))
    wall = time.perf_counter() - start
    after = wait_idle(url, idle_timeout)
    ok = [r for r in results if r["status"] == "ok"]
    latencies = sorted(r["latency"] for r in ok)
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0)
    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    count = {s: sum(r["status"] == s for r in results) for s in ("ok", "cancelled", "error",
                                                                  "lost")}
    summary = {
        "concurrency": concurrency, "requests": len(specs), **count,
        "structured": sum("structured" in r["tags"] and r["status"] == "ok" for r in ok),
        "error_samples": [r["error"] for r in results if r["status"] in ("error", "lost")][:5],
        "latency_p50_s": _percentile(latencies, 50), "latency_p99_s": _percentile(latencies, 99),
        "output_tokens": sum(r.get("tokens", 0) for r in ok), "wall_s": wall,
        "output_tokens_per_s": sum(r.get("tokens", 0) for r in ok) / wall if wall else 0.0,
        "tokens_per_verify_step": 1 + accepted / drafts if drafts else None,
        "engine_steps": int(after.get("vllm:iteration_tokens_total_count", 0)
                            - before.get("vllm:iteration_tokens_total_count", 0)),
        "kv_cache_usage_after": after.get("vllm:kv_cache_usage_perc"),
        "requests_running_after": after.get("vllm:num_requests_running"),
        "health_after": health(url),
    }
    return summary, results


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def replayable(specs: list[dict], results: list[dict]) -> list[dict]:
    """The completed T=0 and seeded requests of a level, each with its text: what the
    reference replays (the texts file keeps them for a later ``--replay``)."""
    by_index = {s["index"]: s for s in specs}
    return [{"spec": by_index[r["index"]],
             "result": {k: r.get(k) for k in ("index", "tags", "status", "text")}}
            for r in results if r["status"] == "ok"
            and ("t0" in r["tags"] or "seeded" in r["tags"])]


def texts_path(out: Path) -> Path:
    return out.with_name(out.stem + ".texts.json")


def compare(ref_url: str, ref_model: str, specs: list[dict], results: list[dict],
            timeout: float, concurrency: int = 8) -> dict:
    """Replay every completed T=0 and seeded request on the reference server (not
    streamed) and compare the texts."""
    by_index = {s["index"]: s for s in specs}
    todo = [r for r in results if r["status"] == "ok"
            and ("t0" in r["tags"] or "seeded" in r["tags"])]
    report: dict = {"t0": [0, 0], "seeded": [0, 0], "mismatches": []}

    def replay(result: dict) -> tuple[dict, dict]:
        spec = dict(by_index[result["index"]], stream=False, cancel_after=None)
        spec["body"] = {k: v for k, v in spec["body"].items()
                        if k not in ("stream", "stream_options")}
        return result, send(ref_url, ref_model, spec, timeout)

    with ThreadPoolExecutor(concurrency) as pool:
        for result, ref in pool.map(replay, todo):
            kind = "t0" if "t0" in result["tags"] else "seeded"
            same = ref["status"] == "ok" and ref.get("text") == result.get("text")
            report[kind][0] += 1
            report[kind][1] += same
            if not same and len(report["mismatches"]) < 10:
                report["mismatches"].append({"index": result["index"], "kind": kind,
                                             "soak": result.get("text"),
                                             "reference": ref.get("text", ref.get("error"))})
    return report


# --- the command ---------------------------------------------------------------------


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --serve starts one)")
    p.add_argument("--model", default="soak", help="the served model name")
    p.add_argument("--serve", help="start a server for this model path")
    p.add_argument("--speculative-config", help="with --serve: the server's JSON")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="with --serve: everything after this goes to the server")
    p.add_argument("--reference-url", help="a plain server to compare T=0 texts with")
    p.add_argument("--reference", action="store_true",
                   help="with --serve: afterwards start a plain server and compare")
    p.add_argument("--reference-concurrency", type=int, default=8,
                   help="requests replayed at once on the reference server")
    p.add_argument("--replay", type=Path, metavar="SOAK_JSON",
                   help="no soak: replay that earlier soak's T=0 and seeded requests "
                        "(from its .texts.json) on a plain server (--serve or "
                        "--reference-url) and write its report with the comparison")
    p.add_argument("--mismatch-ok", action="store_true",
                   help="report differing T=0 texts without failing (bf16 is not "
                        "token-exact)")
    p.add_argument("--requests", type=int, default=200, help="per concurrency level")
    p.add_argument("--concurrency", default="8", help="levels, comma-separated: 8,32,64")
    p.add_argument("--prompt-len", type=_pair, default=(1, 2048), help="tokens, min,max")
    p.add_argument("--output-len", type=_pair, default=(1, 512), help="tokens, min,max")
    p.add_argument("--long-requests", type=int, default=0,
                   help="then this many long greedy requests, one at a time")
    p.add_argument("--long-tokens", type=int, default=3000,
                   help="output tokens of each long request")
    p.add_argument("--min-engine-steps", type=int, default=0,
                   help="fail unless the engine stepped at least this often")
    p.add_argument("--no-structured", action="store_true", help="no structured outputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = p.parse_args(argv)
    if args.replay:
        if bool(args.reference_url) == bool(args.serve) or args.url:
            p.error("--replay needs one plain server: --serve or --reference-url")
        if args.speculative_config or args.reference:
            p.error("--replay compares with a plain server: no --speculative-config "
                    "or --reference")
        if not texts_path(args.replay).exists():
            p.error(f"--replay: {texts_path(args.replay)} is missing (the soak writes it "
                    "beside its JSON)")
        return args
    if bool(args.url) == bool(args.serve):
        p.error("give one of --url and --serve")
    if args.reference and not args.serve:
        p.error("--reference needs --serve (else give --reference-url)")
    return args


def run(args: argparse.Namespace) -> dict:
    if args.replay:
        return run_replay(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    log_dir = args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    server = None
    url = args.url
    extra = list(args.server_args)
    if args.serve:
        spec_args = ([] if args.speculative_config is None
                     else ["--speculative-config", args.speculative_config])
        server, url = start_server(args.serve, args.model, spec_args + extra,
                                   log_dir / f"{args.out.stem}.server.log",
                                   args.startup_timeout)
    levels_out, everything = [], []

    def keep(summary: dict, specs: list[dict], results: list[dict]) -> None:
        # Each level's figures and texts are kept as it ends: a run cut off later
        # keeps them.
        levels_out.append(summary)
        everything.append(replayable(specs, results))
        write_report(args, levels_out, None, partial=True)
        texts_path(args.out).write_text(json.dumps({"levels": everything}) + "\n")

    try:
        for n, concurrency in enumerate(levels):
            specs = make_requests(args.requests, args.seed + n, args.prompt_len,
                                  args.output_len, not args.no_structured)
            summary, results = soak(url, args.model, specs, concurrency, args.timeout, 120.0)
            keep(summary, specs, results)
        if args.long_requests:
            specs = make_long_requests(args.long_requests, args.long_tokens)
            summary, results = soak(url, args.model, specs, 1, args.timeout, 120.0)
            keep(dict(summary, phase="long"), specs, results)
    finally:
        if server is not None:
            stop_server(server)
    reference = None
    ref_url, ref_server = args.reference_url, None
    if args.reference:
        ref_server, ref_url = start_server(args.serve, args.model, extra,
                                           log_dir / f"{args.out.stem}.reference.log",
                                           args.startup_timeout)
    if ref_url:
        try:
            reference = compare_all(ref_url, args, everything)
        finally:
            if ref_server is not None:
                stop_server(ref_server)
    return write_report(args, levels_out, reference)


def compare_all(ref_url: str, args: argparse.Namespace, levels: list[list[dict]]) -> dict:
    """Every level's replayable requests (``replayable``) on the reference server."""
    reference = {"t0": [0, 0], "seeded": [0, 0], "mismatches": []}
    for entries in levels:
        part = compare(ref_url, args.model, [e["spec"] for e in entries],
                       [e["result"] for e in entries], args.timeout,
                       args.reference_concurrency)
        for kind in ("t0", "seeded"):
            reference[kind] = [a + b for a, b in zip(reference[kind], part[kind])]
        reference["mismatches"] += part["mismatches"]
    return reference


def run_replay(args: argparse.Namespace) -> dict:
    """``--replay``: the earlier soak's report, with its texts compared on a plain
    server. The soak's own settings (engine steps asked for) carry over; a soak that
    was cut off stays marked so."""
    earlier = json.loads(args.replay.read_text())
    texts = json.loads(texts_path(args.replay).read_text())["levels"]
    args.min_engine_steps = earlier["config"].get("min_engine_steps", 0)
    server, url = None, args.reference_url
    if args.serve:
        server, url = start_server(args.serve, args.model, list(args.server_args),
                                   args.out.parent / f"{args.out.stem}.reference.log",
                                   args.startup_timeout)
    try:
        reference = compare_all(url, args, texts)
    finally:
        if server is not None:
            stop_server(server)
    return write_report(args, earlier["levels"], reference, partial="partial" in earlier,
                        extra={"soak_config": earlier["config"]})


def write_report(args: argparse.Namespace, levels: list[dict], reference: dict | None,
                 partial: bool = False, extra: dict | None = None) -> dict:
    report = {"config": {k: (str(v) if isinstance(v, Path) else v)
                         for k, v in vars(args).items()},
              "levels": levels, "reference": reference}
    report["engine_steps"] = sum(s.get("engine_steps", 0) for s in levels)
    report["passed"] = (passed(report, args.mismatch_ok) and not partial
                        and report["engine_steps"] >= args.min_engine_steps)
    if partial:
        report["partial"] = "cut off before every level and the reference ran"
    report.update(extra or {})
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def passed(report: dict, mismatch_ok: bool = False) -> bool:
    levels_ok = all(
        s["error"] == 0 and s["lost"] == 0 and s["kv_cache_usage_after"] == 0
        and s["requests_running_after"] == 0 and s["health_after"] == 200
        for s in report["levels"])
    ref = report["reference"]
    return levels_ok and (ref is None or mismatch_ok or ref["t0"][0] == ref["t0"][1])


def print_table(report: dict) -> None:
    cols = ["concurrency", "requests", "ok", "cancelled", "error", "lost", "latency_p50_s",
            "latency_p99_s", "output_tokens_per_s", "tokens_per_verify_step",
            "engine_steps", "kv_cache_usage_after", "health_after"]
    print(" | ".join(cols))
    for s in report["levels"]:
        print(" | ".join(f"{s.get(c):.3g}" if isinstance(s.get(c), float)
                         else str(s.get(c)) for c in cols))
    for s in report["levels"]:
        for sample in s["error_samples"]:
            print(f"  concurrency {s['concurrency']}: {sample}")
    print(f"engine steps: {report['engine_steps']}")
    ref = report["reference"]
    if ref is not None:
        print(f"reference: T=0 {ref['t0'][1]}/{ref['t0'][0]} identical, "
              f"seeded {ref['seeded'][1]}/{ref['seeded'][0]} identical")
        for m in ref["mismatches"][:3]:
            print(f"  request {m['index']} ({m['kind']}): {m['soak']!r} != {m['reference']!r}")
    print("PASSED" if report["passed"] else "FAILED")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print_table(report)
    print(f"wrote {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
