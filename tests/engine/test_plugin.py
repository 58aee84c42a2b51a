"""The vllm.general_plugins entry point: idempotent, version-checked, switchable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "VLLM_PLUGINS": "", **env}  # no automatic plugin loading
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=full_env, timeout=300)


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("ddtree") == "vllm_ddtree:register"


def test_register_is_idempotent():
    result = _run("""
        import vllm_ddtree
        from vllm_ddtree import patches
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        vllm_ddtree.register()
        first = (GPUModelRunner.__init__, dict(patches._orig))
        vllm_ddtree._registered = False  # as if a second process-level call
        vllm_ddtree.register()
        vllm_ddtree.register()
        assert GPUModelRunner.__init__ is first[0]
        assert patches._orig == first[1]
        print("OK", len(patches._orig))
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    # 13 wrapped symbols, each once (the V2 runner's are wrapped only in a worker that
    # builds one for DDTree: patches._patch_worker_for_v2)
    assert "OK 13" in result.stdout


def test_unsupported_vllm_version_names_the_range(tiny_llama, make_drafter):
    drafter = make_drafter(tiny_llama, 8)
    result = _run(f"""
        import vllm
        vllm.__version__ = "0.20.0"
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm.engine.arg_utils import EngineArgs
        from vllm_ddtree import patches
        assert list(patches._orig) == ["create_speculative_config"]
        args = EngineArgs(model={str(tiny_llama)!r}, max_model_len=128, speculative_config={{
            "method": "ddtree", "model": {str(drafter)!r}}})
        try:
            args.create_engine_config()
        except RuntimeError as exc:
            print("ERROR:", exc)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "supports vLLM 0.32.x and 0.33.x; found vLLM 0.20.0" in result.stdout
    assert "VLLM_DDTREE_DISABLE=1" in result.stdout


def test_disable_switch_leaves_vllm_untouched():
    result = _run("""
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        before = GPUModelRunner.__init__
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm_ddtree import patches
        assert GPUModelRunner.__init__ is before and not patches._orig
        print("OK")
    """, VLLM_DDTREE_DISABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout


@pytest.mark.parametrize("value", ["", "0"])
def test_plugin_active_by_default(value):
    result = _run("""
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm_ddtree import patches
        print("PATCHED", sorted(patches._orig))
    """, VLLM_DDTREE_DISABLE=value)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "runner.__init__" in result.stdout
