"""vllm_ddtree/kernels/device.py: where the Triton kernels may run."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.kernels.device import require_triton_device, triton_can_run


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    cpu = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_can_run(cpu)
    with pytest.raises(ValueError, match=r"walk_tree_triton needs CUDA tensors, got cpu; "
                                         r"use ops.walk.walk_tree on the CPU"):
        require_triton_device(cpu, "walk_tree_triton", "ops.walk.walk_tree")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at each call
    assert triton_can_run(cpu)
    require_triton_device(cpu, "walk_tree_triton", "ops.walk.walk_tree")


def test_a_kernel_refuses_cpu_tensors_by_name(monkeypatch):
    from vllm_ddtree.kernels.walk import walk_tree_triton
    from vllm_ddtree.ops.tree import build_ddtree

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tree = build_ddtree(torch.randn(1, 3, 11).log_softmax(-1), torch.tensor([4]), 4)
    with pytest.raises(ValueError, match="use ops.walk.walk_tree on the CPU"):
        walk_tree_triton(tree, torch.zeros(1, 5, dtype=torch.int64), 3)
