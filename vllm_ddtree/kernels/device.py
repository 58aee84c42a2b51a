"""Where the plugin's Triton kernels may run: CUDA tensors, or any tensors under
Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run them on the CPU)."""

from __future__ import annotations

import os

import torch


def triton_can_run(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``tensor`` (read at every call, so a test can
    turn the interpreter on after import)."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton_device(tensor: torch.Tensor, kernel: str, cpu_path: str) -> None:
    """Raise, naming the torch path to use instead, if ``kernel`` cannot take ``tensor``."""
    if not triton_can_run(tensor):
        raise ValueError(
            f"{kernel} needs CUDA tensors, got {tensor.device}; use {cpu_path} on the CPU"
        )
