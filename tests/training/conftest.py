"""A tiny random target, a prompt file of template groups, and one run of the
recipe through its command line (``python -m training``), shared by the modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ddtree.checkpoints import tiny as tm

ROOT = Path(__file__).resolve().parents[2]
# Small enough for a few seconds on two cores: 36 prompts in 6 template groups, short
# continuations, block size 4, a handful of steps.
TINY_RUN = ["--block-size", "4", "--steps", "6", "--batch-size", "4", "--anchors", "8",
            "--log-every", "2", "--save-every", "4", "--max-new-tokens", "24",
            "--warmup", "2", "--heldout-frac", "0.3", "--gen-batch", "16",
            "--drafter-dtype", "float32"]


def write_prompts(path: Path, n: int = 36, groups: int = 6) -> Path:
    templates = ["Explain {w} in one line.", "Write def {w}(x): return x", "{w} is better than",
                 "Tell me about {w}.", "The {w} of the {w}", "Count to {i} and say {w}."]
    words = ["beautiful", "explicit", "simple", "complex", "flat", "sparse", "readability",
             "errors", "namespaces", "practicality"]
    records = [{"prompt": templates[i % groups].format(w=words[i % len(words)], i=i) + f" #{i}",
                "group": f"template-{i % groups}"} for i in range(n)]
    path.write_text(json.dumps(records, indent=0))
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tm.make_target(tmp_path_factory.mktemp("train_target") / "llama", "llama")


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("train_prompts") / "prompts.json")


@pytest.fixture
def one_thread():
    """Torch on one thread while a test trains in this process, as run_cli's runs do:
    on a busy two-core machine two threads make these tiny matmuls ~20x slower, and
    the resumed runs compare bit for bit with run_cli's."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "training", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def tiny_run(tiny_target: Path, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """(run directory, console log) of one complete CLI run on the tiny target."""
    out = tmp_path_factory.mktemp("train_run") / "run"
    proc = run_cli("--target", str(tiny_target), "--prompts", str(prompt_file),
                   "--out", str(out), *TINY_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr
