"""What the Triton kernel tests share: where the kernels run, the skip marks, and
poisoned outputs.

The kernels run on CUDA, or on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, as CI runs them); the sync and graph tests need CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() and not INTERPRET, reason="needs CUDA or TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (sync checks, graphs)"
)


def poisoned_empty(orig):
    """torch.empty / empty_like whose memory holds garbage: -7, True or NaN, so a
    kernel output element that is never written shows."""

    def empty(*args, **kwargs):
        out = orig(*args, **kwargs)
        if out.dtype == torch.bool:
            return out.fill_(True)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    return empty


class KernelRecorder:
    """Stands in for a Triton kernel: each ``kernel[grid](*args, **kwargs)`` appends
    ``(kernel name, {argument name: value})`` to ``calls`` (positional arguments named
    from the kernel's signature), then launches the kernel unless ``launch`` is false."""

    def __init__(self, kernel, calls: list, launch: bool = True):
        self.kernel, self.calls, self.launch = kernel, calls, launch

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.calls.append((self.kernel.__name__,
                               {**dict(zip(self.kernel.arg_names, args)), **kwargs}))
            if self.launch:
                return self.kernel[grid](*args, **kwargs)
            return None

        return record
