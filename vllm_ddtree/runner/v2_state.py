"""The V2 runner's DDTree state: step buffers allocated once, and their views.

The V2 step's launches replay as CUDA graphs over fixed addresses (step_graphs.py), so
everything they read and write lives in :class:`StepBuffers`, made once per engine;
each step uses the leading rows (:class:`StepViews`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.runner.common import RunnerState, StepAttentionInfos
from vllm_ddtree.runner.step_graphs import StepGraphs
from vllm_ddtree.tensors import (
    DDTree,
    WalkResult,
    mask_buffer,
    tree_outputs,
    walk_buffers,
)


@dataclass(frozen=True)
class StepViews:
    """The leading rows of the step buffers that a step of one size uses."""

    tree: DDTree  # [num_reqs, width] per field, row-major
    num_scheduled: torch.Tensor  # [num_reqs] int64
    row_start: torch.Tensor  # [num_reqs] int64
    idx_mapping: torch.Tensor  # [num_reqs] int64
    cu_num_logits: torch.Tensor  # [num_reqs + 1] int32
    walk: WalkResult  # [num_reqs, ...]
    # int64: the walk's output tokens [num_reqs, width], then num_sampled and
    # num_rejected as int32 (split_outputs); one clone hands all three to vLLM.
    outputs: torch.Tensor
    num_sampled: torch.Tensor  # [num_reqs] int32, a view of `outputs`
    num_rejected: torch.Tensor  # [num_reqs] int32, a view of `outputs`


def split_outputs(outputs: torch.Tensor, num_reqs: int, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output tokens [num_reqs, width] int64, num_sampled [num_reqs] int32,
    num_rejected [num_reqs] int32): views of an int64 block laid out as
    StepViews.outputs, each part at a 16-byte boundary (Triton specializes its
    kernels on pointer alignment: the warm-up's variants)."""
    sampled, rejected, end = _output_offsets(num_reqs, width)
    tokens = outputs[: num_reqs * width].view(num_reqs, width)
    num_sampled = outputs[sampled:rejected].view(torch.int32)[:num_reqs]
    return tokens, num_sampled, outputs[rejected:end].view(torch.int32)[:num_reqs]


def _output_offsets(num_reqs: int, width: int) -> tuple[int, int, int]:
    """Where num_sampled and num_rejected start in StepViews.outputs, and where the
    block ends (int64 elements; each part rounded up to two)."""
    counts = 2 * -(-num_reqs // 4)  # num_reqs int32s, in int64s rounded up to two
    sampled = 2 * -(-(num_reqs * width) // 2)
    return sampled, sampled + counts, sampled + 2 * counts


@dataclass
class StepBuffers:
    """Where a verify step's launches read and write, allocated once: the launches
    replay as CUDA graphs over fixed addresses (step_graphs.py)."""

    trees: DDTree  # [max_num_reqs, budget + 1] per field: the trees the step verifies
    num_scheduled: torch.Tensor  # [max_num_reqs] int64, drafts sent per request
    row_start: torch.Tensor  # [max_num_reqs] int64, each request's root row
    idx_mapping: torch.Tensor  # [max_num_reqs] int64, a copy of the batch's state indices
    cu_num_logits: torch.Tensor  # [max_num_reqs + 1] int32, a copy of the batch's
    row_tokens: torch.Tensor  # [max_num_tokens] int64, a copy of the target's tokens
    walk: WalkResult  # [max_num_reqs, ...] the walk's outputs; output_tokens in `outputs`
    # int64, room for StepViews.outputs' layout at every step size.
    outputs: torch.Tensor
    max_depth: int
    _views: dict[tuple[int, int], StepViews] = field(default_factory=dict)

    def views(self, num_reqs: int, width: int) -> StepViews:
        """Made once per (num_reqs, width): slicing ten tensors each step costs the
        host more than the launches the graphs save."""
        views = self._views.get((num_reqs, width))
        if views is None:
            device = self.num_scheduled.device
            outputs = self.outputs[: _output_offsets(num_reqs, width)[2]]
            _, num_sampled, num_rejected = split_outputs(outputs, num_reqs, width)
            views = self._views[(num_reqs, width)] = StepViews(
                tree=DDTree(*tree_outputs(num_reqs, width, device, self.trees)),
                num_scheduled=self.num_scheduled[:num_reqs],
                row_start=self.row_start[:num_reqs],
                idx_mapping=self.idx_mapping[:num_reqs],
                cu_num_logits=self.cu_num_logits[: num_reqs + 1],
                # The walk writes its output tokens into the first num_reqs * width.
                walk=walk_buffers(num_reqs, width, self.max_depth, device, self.walk),
                outputs=outputs,
                num_sampled=num_sampled,
                num_rejected=num_rejected,
            )
        return views

    @classmethod
    def allocate(cls, ddtree: DDTreeConfig, max_num_reqs: int, max_num_tokens: int,
                 device: torch.device) -> StepBuffers:
        width, i64 = ddtree.verify_width, {"dtype": torch.int64, "device": device}
        outputs = torch.zeros(_output_offsets(max_num_reqs, width)[2], **i64)
        return cls(
            trees=DDTree.zeros(max_num_reqs, width, device),
            num_scheduled=torch.zeros(max_num_reqs, **i64),
            row_start=torch.zeros(max_num_reqs, **i64),
            idx_mapping=torch.zeros(max_num_reqs, **i64),
            cu_num_logits=torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device),
            row_tokens=torch.zeros(max_num_tokens, **i64),
            walk=WalkResult(
                accepted_nodes=torch.zeros(max_num_reqs, ddtree.max_depth + 1, **i64),
                num_accepted=torch.zeros(max_num_reqs, **i64),
                bonus_tokens=torch.zeros(max_num_reqs, **i64),
                output_tokens=outputs[: max_num_reqs * width].view(max_num_reqs, width),
            ),
            outputs=outputs,
            max_depth=ddtree.max_depth,
        )


@dataclass(kw_only=True)
class DDTreeV2State(RunnerState):
    """The V2 runner's DDTree state."""

    buffers: StepBuffers
    # The step's launches before the target (the trees) and after it (walk, compaction).
    graphs_before: StepGraphs
    graphs_after: StepGraphs
    # What the attention builders see of each step, its host side kept while the
    # batch's layout repeats.
    attn_infos: StepAttentionInfos = field(default_factory=StepAttentionInfos)
    # The step goes to vLLM's rejection sampler as chains (structured outputs).
    chain_only: bool = False
    # The step holds no prompt tokens (every request schedules its drafts and one more
    # token): only such steps run their launches through the step graphs. A step with a
    # prompt chunk has a token count of its own, and graphs keyed by it would be
    # captured while serving, one per count; its few launches run eagerly instead.
    decode_only: bool = False
    # Query rows per request of the steps that verify trees: budget + 1, and k + 1 for
    # every other size k a step may verify (config.tree_sizes); set by runner/v2.install.
    verify_widths: frozenset = frozenset()
    # The step's ExecuteModelState (hidden states, slot mappings) while it is sampled.
    exec_state: Any = None
    v2_inputs: ClassVar[bool] = True

    @classmethod
    def create(cls, ddtree: DDTreeConfig, max_num_reqs: int, max_num_tokens: int,
               device: torch.device, graphs: bool = True) -> DDTreeV2State:
        """With ``graphs`` (an engine that uses CUDA graphs) the step's own launches
        replay as graphs too (step_graphs.py)."""
        return cls(
            ddtree=ddtree,
            mask_buffer=mask_buffer(max_num_reqs, ddtree.verify_width, device),
            buffers=StepBuffers.allocate(ddtree, max_num_reqs, max_num_tokens, device),
            graphs_before=StepGraphs(device, "tree layout", graphs),
            graphs_after=StepGraphs(device, "walk and compaction", graphs),
            verify_widths=frozenset({ddtree.verify_width}),
        )
