"""benchmarks/bench_serving.py and its helpers: the prompt sets and their overlap with the
drafter's training prompts, the plan, the engine schedule, the streaming client, the
summary on synthetic passes, and one small run on the CPU (slow) read back by the summary."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_e2e
import bench_serving as bench
import prompt_sets
import serving_client
import serving_summary

from training.prompts import build_prompt_records, build_prompts


def have_prompt_packages() -> bool:
    try:
        prompt_sets.package_file(*prompt_sets.MT_BENCH)
        prompt_sets.package_file(*prompt_sets.HUMANEVAL)
    except FileNotFoundError:
        return False
    return True


needs_packages = pytest.mark.skipif(not have_prompt_packages(),
                                    reason=f"prompt packages missing: {prompt_sets.INSTALL_HINT}")


@pytest.fixture(scope="module")
def training_prompts() -> list[str]:
    """The drafter's training prompts, built as training/device_kit.sh built them
    (TRAINING.md: 1,657; the stdlib docstrings in them vary a little by Python version)."""
    prompts = build_prompts()
    assert len(prompts) > 1500
    return prompts


# --- prompt sets --------------------------------------------------------------------------


@needs_packages
def test_mt_bench_is_its_80_first_turns():
    prompts = prompt_sets.mt_bench()
    assert len(prompts) == 80
    assert len({p.id for p in prompts}) == 80
    assert prompts[0].id == "mt-bench/81"  # MT-Bench numbers its questions 81..160
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    rows = prompt_sets.mt_bench_questions()
    assert {r["category"] for r in rows} == {"writing", "roleplay", "reasoning", "math",
                                             "coding", "extraction", "stem", "humanities"}
    assert [p.messages[0]["content"] for p in prompts] == [r["turns"][0] for r in rows]


@needs_packages
def test_humaneval_is_its_164_function_prompts():
    prompts = prompt_sets.humaneval()
    tasks = prompt_sets.humaneval_tasks()
    assert len(prompts) == len(tasks) == 164
    assert prompts[0].id == "humaneval/HumanEval/0"
    assert {"task_id", "prompt", "canonical_solution", "entry_point"} <= set(tasks[0])
    for p, t in zip(prompts, tasks):
        assert t["prompt"] in p.messages[0]["content"]
        assert f"def {t['entry_point']}" in p.messages[0]["content"]


@needs_packages
def test_long_inputs_reach_their_tiers_and_stay_under_4k():
    prompts = prompt_sets.long_inputs()
    assert len(prompts) == 24
    sizes = [prompt_sets.approx_tokens(list(p.messages)) for p in prompts]
    for i, size in enumerate(sizes):
        tier = prompt_sets.LONG_TIERS[(i // 2) % len(prompt_sets.LONG_TIERS)]
        assert tier <= size <= prompt_sets.LONG_MAX_TOKENS, (i, size)
    code, chat = prompts[0::2], prompts[1::2]
    assert all(p.id.startswith("long/code-") and len(p.messages) == 1 for p in code)
    # Conversations: earlier MT-Bench exchanges answered by GPT-4's reference answers.
    answers = {a for turns in prompt_sets.mt_bench_answers().values() for a in turns}
    for p in chat:
        assert p.id.startswith("long/chat-") and p.messages[-1]["role"] == "user"
        assert [m["role"] for m in p.messages[:-1]] == ["user", "assistant"] * (
            (len(p.messages) - 1) // 2)
        assert all(m["content"] in answers for m in p.messages if m["role"] == "assistant")
    assert prompt_sets.long_inputs() == prompts  # seeded


@needs_packages
def test_long_inputs_follow_the_token_counter():
    """With a counter that calls every character a token, each input still lands in
    its tier, and so needs fewer pieces than with the 4-characters estimate."""
    def chars(messages):
        return sum(len(m["content"]) for m in messages)

    prompts = prompt_sets.long_inputs(chars, num=6)
    for i, p in enumerate(prompts):
        assert prompt_sets.LONG_TIERS[(i // 2) % 3] <= chars(list(p.messages)) <= 4096


def test_unknown_set_is_refused():
    with pytest.raises(ValueError, match="mt-bench, humaneval, long, smoke"):
        prompt_sets.load_set("gsm8k")


# --- overlap with the training corpus ------------------------------------------------------


@needs_packages
@pytest.mark.parametrize("name", ["mt-bench", "humaneval", "long"])
def test_benchmark_sets_share_nothing_with_the_training_prompts(name, training_prompts):
    prompts = prompt_sets.load_set(name)
    assert prompt_sets.find_overlaps(prompts, training_prompts) == []


@needs_packages
@pytest.mark.parametrize("name", ["mt-bench", "humaneval"])
def test_benchmark_sets_share_nothing_with_the_larger_corpus(name):
    """The corpus with stdlib functions (``python -m training.prompts --functions``):
    real code, so the check that HumanEval's functions are not among them matters."""
    from training.prompts import FUNCTION_FORMS, stdlib_functions

    functions = build_prompt_records(functions=len(stdlib_functions()))
    # Each function's signature and docstring (form 0) and its source (form 1): the
    # other forms repeat the source.
    per_function = len(FUNCTION_FORMS)
    added = [r["prompt"] for r in functions if r["group"].startswith("lib:")]
    prompts = [p for i, p in enumerate(added) if i % per_function in (0, 1)]
    assert len(prompts) > 4000
    assert prompt_sets.find_overlaps(prompt_sets.load_set(name), prompts) == []


def test_the_smoke_set_is_flagged_as_a_training_prompt(training_prompts):
    """The check is not vacuous: bench_e2e's "code" prompt is one of the training
    templates filled in, and is found by all three tests."""
    found = prompt_sets.find_overlaps(prompt_sets.smoke(), training_prompts)
    assert {(o.prompt_id, o.kind) for o in found} == {
        ("smoke/code", "equal"), ("smoke/code", "contains"), ("smoke/code", "ngram")}


def test_runs_of_numbers_alone_are_not_shared_text():
    corpus = ["Count them: 1 2 3 4 5 6 7 8 9 and then stop counting here now please"]
    numbers = [prompt_sets.BenchPrompt("x/1", ({"role": "user",
                                                "content": "list 1 2 3 4 5 6 7 8 9"},))]
    words = [prompt_sets.BenchPrompt("x/2", ({"role": "user", "content":
                                              "so 9 and then stop counting here now please"},))]
    assert prompt_sets.find_overlaps(numbers, corpus) == []
    assert [o.kind for o in prompt_sets.find_overlaps(words, corpus)] == ["ngram"]


def test_overlap_sees_through_case_punctuation_and_context():
    corpus = ["Write a poem about the first snow.",
              ("Summarize this documentation of the Python module `json`:\n\nJSON "
               "(JavaScript Object Notation) is a subset of JavaScript syntax used as a data "
               "format.")]

    def ask(*texts: str) -> prompt_sets.BenchPrompt:
        return prompt_sets.BenchPrompt("t/1", tuple({"role": "user", "content": t}
                                                    for t in texts))

    def kinds(p):
        return {o.kind for o in prompt_sets.find_overlaps([p], corpus)}

    assert kinds(ask("WRITE a poem -- about the first snow")) == {"equal", "contains"}
    # A whole training prompt inside a longer message, in a later turn.
    assert kinds(ask("Hello.", "Please: write a poem about the first snow, in French.")) == {
        "contains"}
    # Eight words in a row shared with a long training prompt, nothing else.
    assert kinds(ask("Is it true that JSON is a subset of JavaScript syntax used as "
                     "a configuration language?")) == {"ngram"}
    # Seven shared words are a phrase, not a copy.
    assert kinds(ask("Note that a subset of JavaScript syntax used here is small.")) == set()


# --- plan -------------------------------------------------------------------------------


def test_tiny_pair_takes_the_smoke_plan_and_explicit_options_win():
    args = bench.parse_args(["--pair", "tiny", "--max-tokens", "4"])
    assert (args.sets, args.batches, args.concurrency) == (["smoke"], [1, 2], [1, 2])
    assert args.methods == ["plain", "ddtree8"] and args.max_tokens == 4
    full = bench.parse_args([])
    assert full.batches == full.concurrency == [1, 2, 4, 8, 16, 32, 64]
    assert full.sets == ["mt-bench", "humaneval", "long"]
    assert full.methods == ["plain", "chain", "chain-schedule", "ddtree16", "ddtree16-adaptive"]


@pytest.mark.parametrize("argv,seqs", [
    (["--mode", "offline", "--batches", "1,8", "--concurrency", "64"], 8),
    (["--mode", "serve", "--batches", "64", "--concurrency", "2,16"], 16),
    (["--mode", "both", "--batches", "1,32", "--concurrency", "4"], 32),
    (["--mode", "offline", "--batches", "1,8", "--max-num-seqs", "256"], 256),
])
def test_engines_hold_as_many_sequences_as_the_largest_load(argv, seqs):
    """Not vLLM's default of up to 1024: a DDTree engine captures graphs up to it."""
    assert bench.parse_args(argv).max_num_seqs == seqs


@pytest.mark.parametrize("argv", [["--methods", "plain,medusa"], ["--methods", ","],
                                  ["--sets", "gsm8k"], ["--batches", "1,x"],
                                  ["--concurrency", "0"], ["--chain-schedule", "2-8:7"],
                                  ["--chain-schedule", "1-8:7,10-:2"]])
def test_bad_arguments_are_refused_naming_the_option(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[0] in error or "--batches, --concurrency" in error


def test_chain_schedule_is_vllms_ranges_capped_at_the_block():
    assert bench.parse_schedule("1-8:7,9-16:5,17-:9", 7) == [[1, 8, 7], [9, 16, 5],
                                                             [17, 4096, 7]]


def test_methods_and_the_adaptive_key(tmp_path):
    drafter = tmp_path / "d"
    names = ["plain", "chain", "chain-schedule", "ddtree16", "ddtree32-k4",
             "ddtree16-adaptive"]
    before = {m.name: m for m in bench.resolve_methods(names, drafter, 8, "1-4:7,5-:3",
                                                       {"ddtree_budget"})}
    assert before["plain"].config is None
    assert before["chain"].config == {"method": "dflash", "model": str(drafter),
                                      "num_speculative_tokens": 7}
    assert before["chain-schedule"].config["num_speculative_tokens_per_batch_size"] == [
        [1, 4, 7], [5, 4096, 3]]
    assert before["ddtree32-k4"].config == {"method": "ddtree", "model": str(drafter),
                                            "ddtree_budget": 32, "ddtree_topk_cap": 4}
    assert "ddtree_adaptive" not in before["ddtree16"].config
    assert before["ddtree16-adaptive"].skip and not before["ddtree16"].skip
    # Once the plugin has the key, every DDTree row says which it is.
    after = {m.name: m for m in bench.resolve_methods(names, drafter, 8, "1-:7",
                                                      {"ddtree_adaptive"})}
    assert after["ddtree16"].config["ddtree_adaptive"] is False
    assert after["ddtree16-adaptive"].config["ddtree_adaptive"] is True
    assert after["ddtree16-adaptive"].skip is None


def test_a_method_with_eager_steps_runs_its_engine_without_step_graphs(tmp_path,
                                                                      monkeypatch):
    """"-eager-steps" is the same DDTree method with VLLM_DDTREE_STEP_GRAPHS=0 set for
    its server (or offline engine) alone, as an A/B of the step graphs."""
    from vllm_ddtree.runner.step_graphs import ENV_VAR

    methods = {m.name: m for m in bench.resolve_methods(
        ["ddtree16-adaptive", "ddtree16-adaptive-eager-steps", "plain"], tmp_path / "d", 16,
        "1-:15", {"ddtree_adaptive"})}
    eager = methods["ddtree16-adaptive-eager-steps"]
    assert eager.config == methods["ddtree16-adaptive"].config
    assert eager.env == {ENV_VAR: "0"} and not methods["ddtree16-adaptive"].env
    assert not methods["plain"].env
    monkeypatch.delenv(ENV_VAR, raising=False)
    # the server gets it on top of this process's environment; this process does not
    (tmp_path / "env.py").write_text(
        f"import os, sys; open(sys.argv[1], 'w').write(os.environ.get({ENV_VAR!r}, 'unset'))")
    for method, want in ((eager, "0"), (methods["plain"], "unset")):
        out = tmp_path / f"{method.name}.txt"
        server = serving_client.launch_server(
            lambda port, out=out: [sys.executable, str(tmp_path / "env.py"), str(out)],
            tmp_path / "s.log", env=method.env)
        server["proc"].wait(30)
        assert out.read_text() == want
    assert ENV_VAR not in os.environ
    with bench.environment(eager.env):
        assert os.environ[ENV_VAR] == "0"
    assert ENV_VAR not in os.environ
    args = bench.parse_args(["--pair", "tiny", "--methods", "plain,ddtree8-eager-steps"])
    assert args.methods == ["plain", "ddtree8-eager-steps"]


def test_windows_and_pass_sizes():
    assert prompt_sets.pass_size("offline", 1, 8) == 8
    assert prompt_sets.pass_size("offline", 16, 8) == 16
    assert prompt_sets.pass_size("offline", 3, 8) == 9  # whole batches
    assert prompt_sets.pass_size("serve", 1, 8) == 8
    assert prompt_sets.pass_size("serve", 64, 8) == 128
    assert prompt_sets.pass_size("serve", 64, 8, per_slot=8) == 512
    assert prompt_sets.pass_size("serve", 1, 16, per_slot=8) == 16
    assert bench.parse_args(["--pair", "tiny", "--per-slot", "8"]).per_slot == 8
    with pytest.raises(SystemExit):
        bench.parse_args(["--pair", "tiny", "--per-slot", "1"])
    assert prompt_sets.window(list(range(10)), 4, 0) == [0, 1, 2, 3]
    assert prompt_sets.window(list(range(10)), 4, 2) == [8, 9, 0, 1]  # wraps around


def test_dry_run_prints_the_plan(capsys):
    lines = bench.main(["--dry-run", "--pair", "tiny", "--engines", "one-at-a-time"])
    out = capsys.readouterr().out
    assert "set smoke: 4 prompts" in out
    assert any(line.startswith("offline: batch 1,2; per method 4 requests") for line in lines)
    assert any(line.startswith("serve: concurrency 1,2; per method 6 requests") for line in lines)
    assert "one at a time" in out and "ddtree8" in out
    assert "servers" not in out  # one at a time: nothing launches together


def test_dry_run_says_the_servers_launch_at_once_with_the_kv_cache_sized():
    lines = bench.main(["--dry-run", "--pair", "tiny", "--engines", "together", "--mode",
                        "serve"])  # the smoke plan sizes the KV cache
    assert "serve: servers launched at once (KV cache sized ahead)" in lines


@needs_packages
def test_dry_run_of_the_full_plan_counts_every_set(capsys):
    bench.main(["--dry-run", "--engines", "together"])
    out = capsys.readouterr().out
    for expected in ("set mt-bench: 80 prompts", "set humaneval: 164 prompts",
                     "set long: 24 prompts", "together, timed in turn",
                     "ddtree16-adaptive", "servers start one after another"):
        assert expected in out


# --- the engine schedule --------------------------------------------------------------


class FakeDriver:
    """Records the order of starts, timed passes and stops; "broken" fails to start."""

    mode = "offline"

    def __init__(self, fail_timed: bool = False):
        self.log: list[tuple] = []
        self.fail_timed = fail_timed

    def launch(self, methods):
        self.log.append(("launch", *[m.name for m in methods]))

    def start(self, method):
        if method.name == "broken":
            raise ValueError("unknown key")
        self.log.append(("start", method.name))
        return method.name

    def prepare(self, handle, method, keys):
        self.log.append(("prepare", handle))
        return [{"method": method.name, "set": k[0], "tau": 2.0} for k in keys]

    def timed(self, handle, method, key, r):
        if self.fail_timed:
            raise RuntimeError("engine died")
        self.log.append(("timed", handle, key[2], r))
        return {"method": method.name, "load": key[2], "round": r}

    def settings(self, handle):
        return {}

    def stop(self, handle):
        self.log.append(("stop", handle))
        return [f"DDTree tree sizes chosen ({handle})"] if handle == "b" else []

    def close(self):
        self.log.append(("close",))


def methods(*names):
    return [bench.Method(n, None) for n in names]


def test_drive_together_rotates_the_first_engine_and_survives_a_failed_start():
    driver, got = FakeDriver(), []
    bench.drive(driver, methods("a", "broken", "b"), [("s", 0.0, 1), ("s", 0.0, 2)], 2, True,
                lambda kind, item: got.append((kind, item)))
    timed = [(h, load, r) for event, *rest in driver.log if event == "timed"
             for h, load, r in [rest]]
    assert timed == [("a", 1, 0), ("b", 1, 0), ("a", 2, 0), ("b", 2, 0),
                     ("b", 1, 1), ("a", 1, 1), ("b", 2, 1), ("a", 2, 1)]
    # All launched at once, both alive before either warms up, both warm before timing.
    assert driver.log[:5] == [("launch", "a", "broken", "b"), ("start", "a"), ("start", "b"),
                              ("prepare", "a"), ("prepare", "b")]
    assert driver.log[-3:] == [("stop", "a"), ("stop", "b"), ("close",)]
    engines = [item for kind, item in got if kind == "engine"]
    assert [e["status"] for e in engines] == ["ok", "failed: unknown key", "ok"]
    assert sum(kind == "tau" for kind, _ in got) == 4
    # A server's plugin log lines are recorded as it stops; none where it logged none.
    assert [item for kind, item in got if kind == "log"] == [
        {"mode": "offline", "method": "b", "lines": ["DDTree tree sizes chosen (b)"]}]


def test_drive_one_at_a_time_stops_each_engine_before_the_next():
    driver = FakeDriver()
    bench.drive(driver, methods("a", "b"), [("s", 0.0, 1)], 2, False, lambda *_: None)
    assert driver.log == [("start", "a"), ("prepare", "a"), ("timed", "a", 1, 0),
                          ("timed", "a", 1, 1), ("stop", "a"), ("start", "b"),
                          ("prepare", "b"), ("timed", "b", 1, 0), ("timed", "b", 1, 1),
                          ("stop", "b"), ("close",)]


def test_drive_stops_live_engines_when_a_pass_fails():
    driver = FakeDriver(fail_timed=True)
    with pytest.raises(RuntimeError, match="engine died"):
        bench.drive(driver, methods("a", "b"), [("s", 0.0, 1)], 1, True, lambda *_: None)
    assert driver.log[-3:] == [("stop", "a"), ("stop", "b"), ("close",)]


def test_every_engine_starts_from_the_runs_runner_setting(monkeypatch, tmp_path):
    """A DDTree engine sets VLLM_USE_V2_MODEL_RUNNER in this process; the next engine
    (and server) must not inherit it."""
    seen = []
    fake_vllm = SimpleNamespace(LLM=lambda **_: seen.append(
        os.environ.get("VLLM_USE_V2_MODEL_RUNNER")))
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)  # no engine, no vLLM import
    monkeypatch.setattr(serving_client, "RUNNER_ENV", None)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # as a DDTree engine leaves it
    args = bench.parse_args(["--pair", "tiny"])
    args.max_model_len = 256
    bench.OfflineDriver(tmp_path, args, {}, 0.3).start(bench.Method("chain", None))
    assert seen == [None]


def test_server_command_carries_the_engine_settings(tmp_path):
    args = bench.parse_args(["--pair", "tiny", "--graphs", "--max-num-seqs", "64"])
    args.max_model_len = 512
    config = {"method": "ddtree", "model": "d", "ddtree_budget": 8, "ddtree_topk_cap": None}
    driver = serving_client.ServerDriver(tmp_path, args, {}, 0.2)
    cmd = driver.command(bench.Method("t", config), 8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == str(tmp_path) and flags["--port"] == "8123"
    assert flags["--max-model-len"] == "512" and flags["--gpu-memory-utilization"] == "0.2"
    assert flags["--kv-cache-memory-bytes"] == str(1 << 28)  # the smoke plan's
    assert flags["--max-num-seqs"] == "64"
    assert json.loads(flags["--speculative-config"]) == config
    assert "--enforce-eager" not in cmd  # --graphs
    eager = bench.parse_args(["--pair", "tiny"])
    eager.max_model_len = 512
    driver = serving_client.ServerDriver(tmp_path, eager, {}, 0.2)
    plain = driver.command(bench.Method("p", None), 1)
    assert "--enforce-eager" in plain and "--speculative-config" not in plain


def fake_health_server(tmp_path: Path, delay: float = 0.0, code: int | None = None):
    """A command(port) for launch_server: after ``delay`` s, a static HTTP server whose
    /health answers; with ``code``, a process that exits with that code instead."""
    (tmp_path / "health").write_text("ok")
    if code is not None:
        return lambda port: [sys.executable, "-c", f"print('dying'); raise SystemExit({code})"]
    script = (f"import time, http.server, functools; time.sleep({delay}); "
              "h = functools.partial(http.server.SimpleHTTPRequestHandler, "
              f"directory={str(tmp_path)!r}); "
              "http.server.HTTPServer(('127.0.0.1', int(__import__('sys').argv[1])), h)"
              ".serve_forever()")
    return lambda port: [sys.executable, "-c", script, str(port)]


def test_a_launched_server_is_waited_for_until_healthy(tmp_path):
    server = serving_client.launch_server(fake_health_server(tmp_path, delay=1.0),
                                          tmp_path / "s.log")
    try:
        assert serving_client.wait_healthy(server, 30) is server
        assert server["proc"].poll() is None
    finally:
        serving_client.stop_server(server)
    assert server["proc"].poll() is not None and not (tmp_path / "s.log").exists()


def test_a_stopped_server_gives_back_the_plugins_log_lines(tmp_path, monkeypatch):
    """What the tree sizer logged while serving (sizes chosen, steps timed) comes back
    from ServerDriver.stop for the results file; other lines and old ones do not."""
    monkeypatch.setattr(serving_client, "PLUGIN_LINES", 2)
    args = bench.parse_args(["--pair", "tiny"])
    driver = serving_client.ServerDriver(tmp_path, args, {}, 0.2)
    server = serving_client.launch_server(fake_health_server(tmp_path), tmp_path / "s.log")
    with open(tmp_path / "s.log", "a") as log:
        log.write("INFO api_server.py: started\n"
                  "INFO scheduler.py: DDTree: tree size chosen per step\n"
                  "INFO scheduler.py: DDTree tree sizes chosen (batch: nodes) 64 reqs: 0\n"
                  "INFO scheduler.py: DDTree tree sizes chosen (batch: nodes) 8 reqs: 4\n")
    assert driver.stop(server) == [
        "INFO scheduler.py: DDTree tree sizes chosen (batch: nodes) 64 reqs: 0",
        "INFO scheduler.py: DDTree tree sizes chosen (batch: nodes) 8 reqs: 4"]
    assert server["proc"].poll() is not None and not (tmp_path / "s.log").exists()


def test_a_server_that_dies_is_reported_with_its_log(tmp_path):
    server = serving_client.launch_server(fake_health_server(tmp_path, code=3),
                                          tmp_path / "s.log")
    with pytest.raises(RuntimeError, match=r"exited with code 3:\n.*dying"):
        serving_client.wait_healthy(server, 30)


def test_the_start_up_deadline_counts_from_the_launch(tmp_path):
    server = serving_client.launch_server(fake_health_server(tmp_path, delay=30),
                                          tmp_path / "s.log")
    server["launched"] -= 100  # launched long ago, as beside slower servers
    with pytest.raises(RuntimeError, match="not healthy after 5 s"):
        serving_client.wait_healthy(server, 5)
    assert server["proc"].poll() is not None


@pytest.mark.parametrize("kv_bytes", [None, 1 << 28])
def test_servers_launch_together_only_with_the_kv_cache_sized_ahead(monkeypatch, tmp_path,
                                                                    kv_bytes):
    """With --kv-cache-memory-bytes every server is launched before the first is waited
    for; without it (vLLM profiles memory, which servers beside it would upset) each is
    launched when it is started. Servers launched and never started are stopped."""
    events = []
    ports = iter(range(9000, 9010))
    monkeypatch.setattr(serving_client, "launch_server", lambda command, log, taken, env: (
        events.append(("launch", log.stem, sorted(taken)))
        or {"name": log.stem, "port": next(ports)}))
    monkeypatch.setattr(serving_client, "wait_healthy", lambda server, timeout: (
        events.append(("wait", server["name"])) or server))
    monkeypatch.setattr(serving_client, "stop_server", lambda server: events.append(
        ("stop", server["name"])))
    args = bench.parse_args(["--pair", "tiny"])
    args.kv_cache_memory_bytes = kv_bytes
    driver = serving_client.ServerDriver(tmp_path, args, {}, 0.2)
    driver.launch(methods("a", "b", "c"))
    driver.start(bench.Method("a", None))
    driver.start(bench.Method("b", None))
    driver.close()  # c never started: a run cut short
    if kv_bytes:  # each launch told the ports of the servers launched before it
        assert events == [("launch", "a", []), ("launch", "b", [9000]),
                          ("launch", "c", [9000, 9001]), ("wait", "a"), ("wait", "b"),
                          ("stop", "c")]
    else:
        assert events == [("launch", "a", []), ("wait", "a"), ("launch", "b", []),
                          ("wait", "b")]


def test_a_free_port_is_not_one_already_handed_out(monkeypatch):
    class Socket:  # binds to 9000 first, then 9001
        ports = iter([9000, 9001])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(Socket.ports)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(serving_client.socket, "socket", Socket)
    assert serving_client.free_port(frozenset({9000})) == 9001


# --- the streaming client --------------------------------------------------------------


async def fake_server(events_delay: float, peak: list[int], status: str = "200 OK"):
    """An HTTP server streaming a completion as vLLM does (chunked server-sent events,
    one JSON line split over two chunks), counting the requests in flight."""
    in_flight = [0]

    async def handle(reader, writer):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        json.loads(await reader.readexactly(length))
        writer.write(f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\n"
                     "transfer-encoding: chunked\r\n\r\n".encode())
        events = [{"choices": [{"index": 0, "text": "ab"}]},
                  {"choices": [{"index": 0, "text": "cde"}]},
                  {"choices": [], "usage": {"completion_tokens": 5}}]
        body = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events)
        body += b"data: [DONE]\n\n"
        pieces = [body[:10], body[10:body.index(b"cde")], body[body.index(b"cde"):]]
        for piece in pieces:
            await asyncio.sleep(events_delay)
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        in_flight[0] -= 1

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_client_times_a_chunked_stream_and_holds_the_concurrency():
    async def go():
        peak = [0]
        server = await fake_server(0.05, peak)
        port = server.sockets[0].getsockname()[1]
        async with server:
            seconds, results = await serving_client.run_load(port, [{"p": i} for i in range(5)],
                                                             concurrency=2)
        return seconds, results, peak[0]

    seconds, results, peak = asyncio.run(go())
    assert peak == 2
    assert len(results) == 5 and all("error" not in r for r in results)
    for r in results:
        assert r["output_tokens"] == 5 and r["chunks"] == 2
        assert 0.09 <= r["ttft"] < r["latency"]  # the first token arrives in the 2nd piece
        assert r["latency"] - r["ttft"] >= 0.04
    assert seconds >= 3 * 0.15  # five requests, two at a time: three waves


def test_client_reports_errors_without_raising():
    async def go():
        server = await fake_server(0.0, [0], status="400 Bad Request")
        port = server.sockets[0].getsockname()[1]
        async with server:
            _, results = await serving_client.run_load(port, [{}], 1)
        _, refused = await serving_client.run_load(serving_client.free_port(), [{}], 1)
        return results + refused

    bad, refused = asyncio.run(go())
    assert bad["error"].startswith("HTTP/1.1 400")
    assert refused["error"].startswith("connect")


def test_counters_come_from_the_prometheus_text():
    lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts_total counter",
             'vllm:spec_decode_num_drafts_total{engine="0",model_name="bench"} 40.0',
             'vllm:spec_decode_num_drafts_total{engine="1",model_name="bench"} 2.0',
             'vllm:spec_decode_num_drafts_created{engine="0",model_name="bench"} 1.7e9',
             'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="bench"} 61.0',
             'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 30.0']
    text = "\n".join(lines)
    assert serving_client.parse_counters(text) == {"num_drafts": 42.0,
                                                   "num_accepted_tokens": 61.0}


# --- summary ---------------------------------------------------------------------------


def passes(mode: str, method: str, load: int, rates: list[float], **extra) -> list[dict]:
    return [{"mode": mode, "method": method, "set": "mt-bench", "temperature": 0.0,
             "load": load, "round": r, "tokens": 100, "seconds": 100 / x, "tok_per_s": x,
             **extra} for r, x in enumerate(rates)]


def test_summary_pairs_rounds_with_plain_and_the_best_chain():
    run = {"rounds": passes("offline", "plain", 1, [100, 80, 100])
           + passes("offline", "chain", 1, [200, 100, 150])
           + passes("offline", "chain-schedule", 1, [150, 160, 150])
           + passes("offline", "ddtree16", 1, [300, 160, 150]),
           "tau": [{"mode": "offline", "method": "ddtree16", "set": "mt-bench",
                    "temperature": 0.0, "load": 1, "tau": 2.5}]}
    rows = {r["method"]: r for r in serving_summary.summarize([run])}
    assert list(rows) == ["plain", "chain", "chain-schedule", "ddtree16"]  # the run's order
    tree = rows["ddtree16"]
    assert tree["rounds"] == 3 and tree["tau"] == 2.5
    assert tree["tok_per_s"]["median"] == 160
    assert tree["vs_plain"]["median"] == pytest.approx(2.0)  # 3.0, 2.0, 1.5
    assert tree["vs_chain"]["median"] == pytest.approx(1.5)  # 1.5, 1.6, 1.0
    # Best chain per round: 200, 160, 150 -> 1.5, 1.0, 1.0.
    assert tree["vs_best_chain"]["median"] == pytest.approx(1.0)
    assert tree["vs_best_chain"]["range"] == pytest.approx([1.0, 1.5])
    assert rows["plain"]["vs_chain"]["median"] == pytest.approx(2 / 3)  # 0.5, 0.8, 0.667
    low, high = tree["vs_chain"]["interval_90"]
    assert 1.0 <= low <= 1.5 <= high <= 1.6


def test_summary_pools_runs_and_reports_serving_latencies(tmp_path, capsys):
    def serve_run(scale: float) -> dict:
        return {"engines_together": True, "rounds": passes(
            "serve", "chain", 4, [100 * scale, 100 * scale], ttft_s=[0.01, 0.02],
            tpot_s=[0.001, 0.003], requests=2, errors=[], tau=2.0)
            + passes("serve", "ddtree16", 4, [120 * scale, 110 * scale],
                     ttft_s=[0.03] * 100, tpot_s=[0.002] * 99 + [0.1], requests=100,
                     errors=["HTTP/1.1 500"], tau=3.0)}

    paths = []
    for i, scale in enumerate((1.0, 2.0)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(serve_run(scale)))
    out = bench.main(["--summarize", *map(str, paths), "--out", str(tmp_path / "pooled")])
    rows = {r["method"]: r for r in out["rows"]}
    tree = rows["ddtree16"]
    assert (tree["runs"], tree["rounds"], tree["tau"]) == (2, 4, 3.0)
    assert tree["vs_chain"]["median"] == pytest.approx(1.15)  # 1.2, 1.1 in each run
    assert tree["ttft_ms"]["p50"] == pytest.approx(30.0)
    assert tree["tpot_ms"]["p50"] == pytest.approx(2.0)
    assert tree["tpot_ms"]["p99"] > 2.0  # the one slow request shows at p99
    assert tree["requests"] == 400 and tree["errors"] == 4
    assert rows["chain"]["ttft_ms"] == {"p50": 15.0, "p99": 20.0}  # four of each
    saved = json.loads((tmp_path / "pooled.json").read_text())
    assert saved["rows"] == out["rows"] and saved["files"] == [str(p) for p in paths]
    table = capsys.readouterr().out
    assert "[serve]" in table and "concurrency" in table and "4 errors" in table


def test_summary_refuses_other_files(tmp_path):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": {}}))
    with pytest.raises(SystemExit, match="not a bench_serving.py results file"):
        bench.main(["--summarize", str(path), "--out", str(tmp_path / "x")])


def test_percentile_interpolates():
    assert serving_summary.percentile([], 50) is None
    assert serving_summary.percentile([3.0], 99) == 3.0
    assert serving_summary.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert serving_summary.percentile(list(range(101)), 99) == 99


def test_reuses_bench_e2e_rather_than_copying_it():
    assert bench.RESULTS == bench_e2e.RESULTS
    assert serving_summary.bench_e2e.bootstrap_median is bench_e2e.bootstrap_median


# --- one small run on the CPU ----------------------------------------------------------------


@pytest.mark.slow
def test_smoke_run_on_the_cpu_writes_what_the_summary_reads(tiny_llama, make_drafter,
                                                            tmp_path):
    """Plain decoding and DDTree, offline at batch 1 and 2 and through the server at 1
    and 2 concurrent requests, both engines alive and timed in turn (the servers
    launched at once, the KV cache being sized): a results file whose rows the summary
    pools, with tau from vLLM's counters and latencies from the client."""
    drafter = make_drafter(tiny_llama, 8, mode="repeat")
    stem = tmp_path / "smoke"
    data = bench.main(["--target", str(tiny_llama), "--drafter", str(drafter),
                       "--methods", "plain,ddtree8", "--sets", "smoke", "--batches", "1,2",
                       "--concurrency", "1,2", "--max-tokens", "8", "--rounds", "1",
                       "--min-prompts", "2", "--engines", "together",
                       "--kv-cache-memory-bytes", str(1 << 28), "--out", str(stem)])
    assert [e["status"] for e in data["engines"]] == ["ok"] * 4
    assert len(data["rounds"]) == 8  # 2 modes x 2 methods x 2 loads x 1 round
    assert all(r["tokens"] == 8 * (2 if r["load"] == 1 or r["mode"] == "offline" else 4)
               for r in data["rounds"])
    serve = [r for r in data["rounds"] if r["mode"] == "serve"]
    assert all(not r["errors"] and len(r["ttft_s"]) == r["requests"] for r in serve)
    assert all(r["tau"] is not None for r in serve if r["method"] == "ddtree8")
    summary = bench.main(["--summarize", f"{stem}.json", "--out", str(tmp_path / "read")])
    rows = {(r["mode"], r["method"], r["load"]): r for r in summary["rows"]}
    assert set(rows) == {(m, n, b) for m in ("offline", "serve") for n in ("plain", "ddtree8")
                         for b in (1, 2)}
    assert rows[("offline", "ddtree8", 1)]["tau"] >= 1.0
    assert rows[("offline", "ddtree8", 2)]["vs_plain"]["median"] > 0
    assert rows[("serve", "ddtree8", 2)]["ttft_ms"]["p50"] > 0
    assert data["summary"] == summary["rows"]


def test_plot_without_rows_draws_nothing(tmp_path):
    """A run whose engines all failed has no rows: no figure, no error."""
    assert serving_summary.plot([], tmp_path / "none.png") is False
    assert not (tmp_path / "none.png").exists()


def test_a_drafter_alone_pairs_with_the_real_target(capsys):
    """--drafter without --target serves the real target (the shipped b16 drafter's
    block size reaches the chain); --target needs its drafter; --pair tiny has its own."""
    b16 = Path(bench.__file__).resolve().parent.parent / "models" / "dflash-smollm2-135m-b16"
    bench.main(["--dry-run", "--sets", "smoke", "--methods", "chain", "--drafter", str(b16)])
    out = capsys.readouterr().out
    assert "SmolLM2-135M" in out and f"{b16} (block 16)" in out
    assert '"num_speculative_tokens": 15' in out
    with pytest.raises(SystemExit, match="--target needs --drafter"):
        bench.main(["--dry-run", "--sets", "smoke", "--target", str(b16)])
    with pytest.raises(SystemExit, match="--pair tiny"):
        bench.main(["--dry-run", "--pair", "tiny", "--drafter", str(b16)])


@needs_packages
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mt-bench", "humaneval"])
def test_benchmark_sets_share_nothing_with_the_word_prompts(name, smollm2):
    """The open requests around the real target's vocabulary words
    (``python -m training.prompts --words 12000 --vocab .../tokenizer.json``)."""
    records = build_prompt_records(words=12000, vocab=smollm2 / "tokenizer.json")
    prompts = [r["prompt"] for r in records if r["group"].startswith("words:")]
    assert len(prompts) == 12000
    assert prompt_sets.find_overlaps(prompt_sets.load_set(name), prompts) == []
