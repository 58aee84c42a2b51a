"""Keeping the host from waiting on the GPU: non-blocking copies, and a debugging
switch that proves the DDTree step never makes the host wait.

With ``VLLM_DDTREE_CHECK_SYNC=1`` every DDTree hook on a CUDA device runs under
``torch.cuda.set_sync_debug_mode("error")``: any operation that would block
the host on the GPU (``.item()``, ``.tolist()``, boolean indexing, a pageable
copy) raises instead. The GPU tests turn it on; users never need it. Penalties
read per-request host lists and sync by design (as vLLM's own penalties do).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV_VAR = "VLLM_DDTREE_CHECK_SYNC"
# Read once per process (vLLM's engine process starts with the user's environment):
# the check wraps every layer's attention, so a disabled one must cost nothing.
_ENABLED = os.environ.get(ENV_VAR, "0") not in ("", "0")


@contextmanager
def no_host_sync(device: torch.device | str) -> Iterator[None]:
    """Inside the block, a host-device sync on ``device`` raises (when enabled)."""
    if not _ENABLED or torch.device(device).type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def step_phase(label: str, device: torch.device | str) -> Iterator[None]:
    """A DDTree part of the step: a named range for torch.profiler
    (``benchmarks/profile_gpu_step.py`` reads them) that must not sync the host.
    Without a running profiler no range is opened (a few microseconds each, four
    times a step)."""
    if not torch._C._autograd._profiler_enabled():
        with no_host_sync(device):
            yield
        return
    with torch.profiler.record_function(label), no_host_sync(device):
        yield


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to ``device`` without making the host wait (pinned on CUDA)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
