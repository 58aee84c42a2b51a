"""scripts/detached.sh: a command that goes on after the call that started it returns,
waited for, stopped with every process it started, its exit code kept."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "detached.sh"
STILL_RUNNING = 75


def detached(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], check=False, cwd=cwd,
                          timeout=60, capture_output=True, text=True)


def test_the_run_outlives_its_starter_and_its_code_comes_back(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "done"
    started = time.monotonic()
    out = detached("start", run, "bash", "-c", f"sleep 1.5; echo written; touch {marker}")
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 1.5  # start returned before the command ended
    assert detached("alive", run).returncode == 0 and not marker.exists()
    assert detached("wait", run, 0).returncode == STILL_RUNNING
    done = detached("wait", run, 20)
    assert done.returncode == 0 and marker.exists(), done.stdout
    assert (run / "log").read_text() == "written\n"
    assert detached("alive", run).returncode != 0


def test_a_failed_run_gives_its_own_exit_code(tmp_path):
    run = tmp_path / "run"
    assert detached("start", run, "bash", "-c", "echo oops >&2; exit 7").returncode == 0
    done = detached("wait", run, 20)
    assert done.returncode == 7 and "exit code 7" in done.stdout
    assert (run / "log").read_text() == "oops\n"


def test_the_command_runs_from_the_starters_directory(tmp_path):
    run, work = tmp_path / "run", tmp_path / "work"
    work.mkdir()
    assert detached("start", run, "pwd", cwd=work).returncode == 0
    assert detached("wait", run, 20).returncode == 0
    assert (run / "log").read_text().strip() == str(work)


def test_stop_ends_the_run_and_the_processes_it_started(tmp_path):
    run, child = tmp_path / "run", tmp_path / "child.pid"
    # The command starts a child in a process group of its own (as `timeout` does) and
    # waits for it.
    out = detached("start", run, "bash", "-c",
                   f"timeout 300 sleep 300 & t=$!; sleep 0.3; pgrep -P $t > {child}; wait")
    assert out.returncode == 0, out.stderr
    for _ in range(100):
        if child.exists() and child.read_text().strip():
            break
        time.sleep(0.05)
    pid = int(child.read_text())
    os.kill(pid, 0)  # alive
    assert detached("start", run, "true").returncode == 1  # one run at a time
    assert detached("stop", run).returncode == 0
    assert detached("alive", run).returncode != 0
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break  # ended, not yet reaped by its parent
        time.sleep(0.05)
    else:
        raise AssertionError(f"the run's child {pid} outlived stop")
    assert detached("wait", run, 1).returncode == 1  # killed: no exit code of its own


def test_nothing_to_start_or_wait_for(tmp_path):
    assert detached("start", tmp_path / "run").returncode == 2
    assert detached("stop", tmp_path / "none").returncode == 0
    none = detached("wait", tmp_path / "none", 0)
    assert none.returncode == 1 and "no run was started" in none.stdout
