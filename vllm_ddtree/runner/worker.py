"""DDTree's GPU worker: vLLM's own, building DDTree's model runner.

vLLM builds each worker from ``parallel_config.worker_cls``; for a DDTree engine the
plugin names this class there (patches.py), and its ``_make_model_runner`` (vLLM's seam
for exactly this) returns the DDTree subclass of the runner vLLM would have built: V2
(:class:`~vllm_ddtree.runner.v2.DDTreeV2ModelRunner`) or V1
(:class:`~vllm_ddtree.runner.v1.DDTreeModelRunner`).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_ddtree import patches


class DDTreeWorker(Worker):
    """vLLM's GPU worker with a DDTree model runner."""

    def _make_model_runner(self):
        if self.use_v2_model_runner:
            from vllm_ddtree.runner.v2 import DDTreeV2ModelRunner
            from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

            patches.apply_engine_patches("v2", speculator_cls=DDTreeSpeculator)
            return DDTreeV2ModelRunner(self.vllm_config, self.device)
        from vllm_ddtree.runner.v1 import DDTreeModelRunner

        patches.apply_engine_patches("v1")
        return DDTreeModelRunner(self.vllm_config, self.device)
