"""The vllm.general_plugins entry point and patches.py: idempotent, version-checked,
switchable, light in processes that never build a DDTree engine, and the seams a
DDTree engine is built through."""

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


def test_register_is_idempotent_and_patches_only_the_process_wide_symbols():
    result = _run("""
        import vllm_ddtree
        from vllm_ddtree import patches
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        before = dict(vars(GPUModelRunner))
        vllm_ddtree.register()
        first = dict(patches._orig)
        vllm_ddtree._registered = False  # as if a second process-level call
        vllm_ddtree.register()
        vllm_ddtree.register()
        assert patches._orig == first
        assert dict(vars(GPUModelRunner)) == before  # runners are subclassed, not patched
        print("PATCHED", sorted(patches._orig))
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("PATCHED ['SamplingParams._validate_spec_decode', "
            "'VllmConfig._set_cudagraph_sizes', 'create_speculative_config', "
            "'num_lookahead_tokens']") in result.stdout


def test_register_loads_no_kernel_and_no_runner_where_no_ddtree_engine_is_built(tiny_llama):
    """In a process that never builds a DDTree engine (an API server, a plain engine),
    register() and a plain engine's config import none of the plugin's kernels,
    runners, ops or attention backends, and nothing of Triton beyond what vLLM has."""
    result = _run(f"""
        import sys
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        before = set(sys.modules)
        import vllm_ddtree
        vllm_ddtree.register()
        EngineArgs(model={str(tiny_llama)!r}, max_model_len=128).create_engine_config()
        new = sorted(set(sys.modules) - before)
        heavy = [m for m in new if m.startswith(("triton", "vllm_ddtree.kernels",
                 "vllm_ddtree.runner", "vllm_ddtree.ops", "vllm_ddtree.attention"))]
        print("PLUGIN", [m for m in new if m.startswith("vllm_ddtree")])
        print("HEAVY", heavy)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "HEAVY []" in result.stdout, result.stdout
    assert "vllm_ddtree.patches" in result.stdout  # it did register


def test_a_ddtree_engine_is_built_by_ddtrees_worker(tiny_llama, make_drafter):
    """vLLM's worker_cls seam: a DDTree config names DDTree's worker for the platform
    (which builds DDTree's runner); a plain config leaves vLLM's choice alone; a
    worker_cls of the user's own is refused with a message that says why."""
    drafter = make_drafter(tiny_llama, 8)
    result = _run(f"""
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm.engine.arg_utils import EngineArgs
        spec = {{"method": "ddtree", "model": {str(drafter)!r}}}
        plain = EngineArgs(model={str(tiny_llama)!r}, max_model_len=128)
        ddtree = EngineArgs(model={str(tiny_llama)!r}, max_model_len=128,
                            speculative_config=spec)
        print("PLAIN", plain.create_engine_config().parallel_config.worker_cls)
        print("DDTREE", ddtree.create_engine_config().parallel_config.worker_cls)
        own = EngineArgs(model={str(tiny_llama)!r}, max_model_len=128,
                         speculative_config=spec, worker_cls="my.Worker")
        try:
            own.create_engine_config()
        except ValueError as exc:
            print("REFUSED", exc)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "PLAIN vllm.v1.worker.cpu_worker.CPUWorker" in result.stdout
    assert "DDTREE vllm_ddtree.runner.cpu_worker.DDTreeCPUWorker" in result.stdout
    assert "REFUSED" in result.stdout and "'my.Worker'" in result.stdout


def test_engine_patches_apply_once_and_only_for_their_runner():
    result = _run("""
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm_ddtree import patches
        from vllm.v1.worker import gpu_model_runner
        before = gpu_model_runner.build_logitsprocs
        patches.apply_engine_patches("v1")
        patched = gpu_model_runner.build_logitsprocs
        patches.apply_engine_patches("v1")
        assert patched is not before and gpu_model_runner.build_logitsprocs is patched
        assert patches._orig["build_logitsprocs"] is before
        print("ENGINE", sorted(patches._orig))
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "'build_logitsprocs'" in result.stdout and "v2.init_speculator" not in result.stdout


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
        from vllm.engine.arg_utils import EngineArgs
        before = EngineArgs.create_speculative_config
        import vllm_ddtree
        vllm_ddtree.register()
        from vllm_ddtree import patches
        assert EngineArgs.create_speculative_config is before and not patches._orig
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
    assert "create_speculative_config" in result.stdout
