"""scripts/gpu_ab.sh: the earlier version it measures is that commit's plugin, and the
device side refuses to run without it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                                reason="needs git and a clone")


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_prepare_takes_the_commits_plugin(tmp_path):
    clone = tmp_path / "clone"
    git("clone", "-q", str(REPO), str(clone), cwd=tmp_path)
    # An earlier version of the plugin where the history has one (a shallow clone: HEAD).
    earlier = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD~1"], cwd=clone,
                             capture_output=True, text=True, check=False)
    ref = earlier.stdout.strip() or git("rev-parse", "HEAD", cwd=clone)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_ab.sh"), "prepare", ref],
                          cwd=clone, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (clone / "ab_ref" / "REF").read_text().strip() == ref
    files = git("ls-tree", "-r", "--name-only", ref, "vllm_ddtree", cwd=clone).splitlines()
    assert files
    for rel in files:
        blob = subprocess.run(["git", "show", f"{ref}:{rel}"], cwd=clone, check=True,
                              capture_output=True).stdout
        assert (clone / "ab_ref" / rel).read_bytes() == blob
    assert git("status", "--porcelain", "--", "ab_ref", cwd=clone) == ""  # ignored


def test_run_refuses_without_the_earlier_version(tmp_path):
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_ab.sh"), "run"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "ab_ref/ is missing" in done.stderr


def test_summary_pairs_each_rounds_engines(tmp_path):
    """The table at the end of `run`: one row per (round, method, batch) both versions
    measured, with the new/ref ratio and the plugin digests the runs recorded."""
    script = (REPO / "scripts" / "gpu_ab.sh").read_text()
    start = script.index("<<'EOF'\n") + len("<<'EOF'\n")
    summary = script[start:script.index("\nEOF\n", start)]
    for version, ms, digest in (("ref", 10.0, "aaaa"), ("new", 9.0, "bbbb")):
        runs = [{"method": "ddtree", "rows": [{"batch": 1, "ms_per_step": ms}]},
                {"method": "chain", "rows": [{"batch": 1, "ms_per_step": 8.0}]}]
        (tmp_path / f"ab_{version}_1.json").write_text(json.dumps(
            {"environment": {"plugin_digest": digest}, "runs": runs}))
    (tmp_path / "ab_ref_2.json").write_text(json.dumps({"environment": {}, "runs": []}))
    done = subprocess.run([sys.executable, "-", str(tmp_path)], input=summary, text=True,
                          capture_output=True, check=True)
    lines = done.stdout.splitlines()
    assert "| 1 | ddtree | 1 | 10.000 | 9.000 | 0.900 |" in lines
    assert "| 1 | chain | 1 | 8.000 | 8.000 | 1.000 |" in lines
    assert "<!-- round 1: plugin digests ref aaaa, new bbbb -->" in lines
    assert not any(line.startswith("| 2 ") for line in lines)  # round 2 has no new run
