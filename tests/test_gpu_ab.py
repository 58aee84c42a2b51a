"""scripts/gpu_ab.sh: the earlier version it measures is that commit's plugin, and the
device side refuses to run without it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

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
