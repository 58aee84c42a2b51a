"""DDTree on vLLM's V1 model runner (the CPU backend's, and the GPU's where V1 runs).

:class:`DDTreeRunnerMixin` overrides the runner's methods where a line of the step
(``ops/step.py``) happens; the functions below do the work:

1-2. draft, build the tree: ``runner.drafter`` is a
     :class:`~vllm_ddtree.runner.v1_proposer.DDTreeProposer` (one DFlash pass, then the
     tree); after drafting, :func:`record_drafted_trees` notes which request owns which
     tree;
3.   verify: after ``_prepare_inputs``, :func:`begin_verify_step` gives verify rows
     their depth positions (KV slots stay ``start + i``) and publishes the ancestor
     masks to the attention metadata builders;
4-5. the target's token at every node, the walk: ``runner.rejection_sampler`` is a
     :class:`~vllm_ddtree.runner.v1_sampler.DDTreeSampler`;
6.   compaction, after sampling (:func:`compact_after_walk`): the accepted path looks
     like a chain whose first k drafts were accepted (KV rows, hidden states,
     positions, tokens).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ddtree.attention.state import (
    TreeAttentionInfo,
    causal_attention_info,
    publishing,
)
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.kernels.step_trees import step_trees_triton
from vllm_ddtree.ops.step_trees import step_trees, tree_positions
from vllm_ddtree.runner.common import (
    RunnerState,
    check_tree_backends,
    compact_accepted,
    log_graph_coverage,
    step_attention_info,
    warm_up_kernels,
)
from vllm_ddtree.runner.v1_sampler import DDTreeSampler
from vllm_ddtree.sync import step_phase, to_device
from vllm_ddtree.tensors import DDTree, TreeVerifyStep, mask_buffer

if TYPE_CHECKING:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers


@dataclass(kw_only=True)
class DDTreeRunnerState(RunnerState):
    """The V1 runner's DDTree state."""

    # req_id -> row of the drafter's last tree, set after each drafting pass.
    tree_rows: dict[str, int] = field(default_factory=dict)
    # Tensors of the step being sampled (hidden states, aux states, slots).
    model_state: Any = None
    # Each request's root row, [max_num_reqs] int64, written at every verify step.
    row_start_buffer: torch.Tensor | None = None


def install(runner: GPUModelRunner) -> None:
    """Make a freshly built V1 model runner a DDTree runner: its state, drafter and
    rejection sampler."""
    ddtree = get_ddtree_config(runner.vllm_config)
    if ddtree is None:
        raise ValueError("a DDTree model runner needs a DDTree speculative config")
    if runner.uses_mrope:
        raise NotImplementedError("DDTree does not support M-RoPE target models yet.")
    from vllm_ddtree.attention import register_backends
    from vllm_ddtree.runner.v1_proposer import DDTreeProposer

    register_backends(runner.device)
    state = DDTreeRunnerState(
        ddtree=ddtree,
        mask_buffer=mask_buffer(runner.max_num_reqs, ddtree.verify_width, runner.device),
        row_start_buffer=torch.zeros(runner.max_num_reqs, dtype=torch.int64,
                                     device=runner.device),
    )
    runner.ddtree_state = state
    runner.drafter = DDTreeProposer(runner.vllm_config, runner.device, runner)
    runner.rejection_sampler = DDTreeSampler(runner.sampler, lambda: state.step)
    logger.info(
        "DDTree runner: verify width %d, drafter width %d, async scheduling %s.",
        ddtree.verify_width,
        ddtree.drafter_width,
        "on" if runner.use_async_scheduling else "off",
    )
    log_graph_coverage(runner.vllm_config, ddtree)


def begin_verify_step(
    runner: GPUModelRunner, spec_decode_metadata: SpecDecodeMetadata | None
) -> None:
    """Attach this step's trees to the batch and set depth positions.

    Host-side sizes come from host copies vLLM already keeps; nothing here
    waits for the device. The GPU idles while this runs (the step's first
    kernels follow it), so the host arithmetic is numpy's, whose operators cost
    less per call than torch's on CPU tensors.
    """
    state: DDTreeRunnerState = runner.ddtree_state
    state.step = state.attn_info = None
    if spec_decode_metadata is None:
        return
    num_reqs = runner.input_batch.num_reqs
    device = runner.positions.device
    query_start_host = runner.query_start_loc.cpu[: num_reqs + 1].numpy().astype(np.int64)

    # Trees come from the drafter; any request without one (or whose drafts
    # were changed on the way, or that is grammar-constrained) is verified as
    # the chain it was sent as. Counts and tree rows travel in one copy.
    drafted: DDTree | None = getattr(runner.drafter, "last_tree", None)
    host = np.full((2, num_reqs), -1, dtype=np.int64)
    host[0] = spec_decode_metadata.num_draft_tokens
    num_draft = host[0]
    width = int(num_draft.max()) + 1
    has_rows = drafted is not None and bool(state.tree_rows)
    if has_rows:
        host[1] = [-1 if _has_grammar(runner, rid) else state.tree_rows.get(rid, -1)
                   for rid in runner.input_batch.req_ids]
    on_device = to_device(torch.from_numpy(host), device)
    num_scheduled = on_device[0]
    index = on_device[1] if has_rows else None
    # The masks are packed straight into the buffer the tree kernel reads. Siblings
    # share a position: node i of a request sits at start + depth_i (its KV slot
    # stays start + i, from vLLM's slot mapping); on CUDA the same launch moves them.
    query_start = runner.query_start_loc.gpu[: num_reqs + 1]
    if runner.device.type == "cuda":
        row_start = state.row_start_buffer[:num_reqs]
        tree = step_trees_triton(drafted, index, spec_decode_metadata.draft_token_ids,
                                 spec_decode_metadata.cu_num_draft_tokens, num_scheduled,
                                 width, packed_out=state.mask_buffer,
                                 positions=runner.positions, query_start_loc=query_start,
                                 row_start_out=row_start)
    else:
        tree = step_trees(drafted, index, spec_decode_metadata, num_scheduled, width,
                          packed_out=state.mask_buffer)
        row_start = tree_positions(runner.positions, query_start, num_scheduled, tree.depths)

    state.step = TreeVerifyStep(
        tree=tree,
        num_scheduled=num_scheduled,
        row_start=row_start,
        max_depth=state.ddtree.max_depth,
    )
    state.attn_info = step_attention_info(tree, query_start_host, num_draft, state.mask_buffer)


def capture_attention_info(
    runner: GPUModelRunner, num_reqs: int, max_query_len: int, for_capture: bool
) -> TreeAttentionInfo | None:
    """A causal tree for vLLM's capture of a full CUDA graph of uniform verify shape
    (``budget + 1`` rows per request), so the graph holds the tree kernel and its
    launch plan; each replay then reads that step's masks from the runner's mask
    buffer. Causal, because the capture's dummy batch carries no tree."""
    state: DDTreeRunnerState = runner.ddtree_state
    width = state.ddtree.verify_width
    if not for_capture or runner.device.type != "cuda" or max_query_len != width:
        return None
    query_start_loc = runner.query_start_loc.cpu[: num_reqs + 1]
    return causal_attention_info(query_start_loc, width, state.mask_buffer)


def may_replay_full_graph(state: DDTreeRunnerState) -> bool:
    """Whether this step may run in a full CUDA graph (one holds the tree kernel over
    every row): only when every query row belongs to a tree. A uniform batch
    without trees (a prefill chunk of exactly ``budget + 1`` tokens, alone or next
    to trees) runs piecewise instead, with attention outside the graph."""
    return state.attn_info is not None and state.attn_info.all_rows_are_tree_rows


def compact_after_walk(runner: GPUModelRunner) -> None:
    """Make the accepted path look like a chain step with k accepted drafts."""
    state: DDTreeRunnerState = runner.ddtree_state
    step, model_state = state.step, state.model_state
    if step is None or step.walk is None or model_state is None:
        return
    compact_accepted(runner, state, step, model_state.slot_mappings,
                     [model_state.hidden_states, *(model_state.aux_hidden_states or [])],
                     runner.input_ids.gpu, runner.positions)


def record_drafted_trees(runner: GPUModelRunner) -> None:
    """After drafting: the drafter's trees are in input-batch order."""
    state: DDTreeRunnerState = runner.ddtree_state
    if getattr(runner.drafter, "last_tree", None) is None:
        state.tree_rows = {}
        return
    state.tree_rows = {rid: i for i, rid in enumerate(runner.input_batch.req_ids)}


def _has_grammar(runner: GPUModelRunner, req_id: str) -> bool:
    """Structured-output requests are verified as chains: vLLM validates and
    masks their drafts as a chain, so a tree walk would use wrong masks."""
    params = runner.requests[req_id].sampling_params
    return params is not None and params.structured_outputs is not None


_BUILD_SIGNATURE = inspect.signature(GPUModelRunner._build_attention_metadata)


class DDTreeRunnerMixin:
    """DDTree's overrides of vLLM's V1 model runner, for ``GPUModelRunner`` and the CPU
    backend's subclass alike (runner/cpu_worker.py). Each calls vLLM's method and adds
    one line of the step; nothing else of the runner changes."""

    ddtree_state: DDTreeRunnerState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install(self)  # drafter and rejection sampler: lines 1-2 and 4-5

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        check_tree_backends(self)  # every target layer has tree attention (line 3)
        warm_up_kernels(self)

    def _prepare_inputs(self, scheduler_output: Any, *args: Any, **kwargs: Any):
        result = super()._prepare_inputs(scheduler_output, *args, **kwargs)
        with step_phase("ddtree.begin_verify", self.device):
            begin_verify_step(self, result[1])  # line 3: depth positions, masks
        return result

    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any):
        # A full CUDA graph holds the tree kernel over every row: only steps whose every
        # row is a tree row may replay one (a capture passes force_uniform_decode itself).
        if kwargs.get("force_uniform_decode") is None and not may_replay_full_graph(
            self.ddtree_state
        ):
            kwargs["force_uniform_decode"] = False
        return super()._determine_batch_execution_and_padding(*args, **kwargs)

    def _build_attention_metadata(self, *args: Any, **kwargs: Any):
        info = self.ddtree_state.attn_info
        if info is None:  # a step without trees, or a graph capture
            call = _BUILD_SIGNATURE.bind(self, *args, **kwargs)
            call.apply_defaults()
            batch = call.arguments
            info = capture_attention_info(self, batch["num_reqs"], batch["max_query_len"],
                                          bool(batch.get("for_cudagraph_capture")))
        with publishing(info):  # line 3: the builders attach the step's tree
            return super()._build_attention_metadata(*args, **kwargs)

    def sample_tokens(self, *args: Any, **kwargs: Any):
        state = self.ddtree_state
        state.model_state = self.execute_model_state
        state.tree_rows = {}  # this step's trees were consumed by _prepare_inputs
        try:
            return super().sample_tokens(*args, **kwargs)  # lines 4-5 in the sampler
        finally:
            state.model_state = state.step = state.attn_info = None

    def _sample(self, logits: Any, spec_decode_metadata: Any):
        output = super()._sample(logits, spec_decode_metadata)
        if spec_decode_metadata is not None:
            with step_phase("ddtree.compact", self.device):
                compact_after_walk(self)  # line 6
        return output

    def propose_draft_token_ids(self, *args: Any, **kwargs: Any):
        draft_token_ids = super().propose_draft_token_ids(*args, **kwargs)  # lines 1-2
        record_drafted_trees(self)
        return draft_token_ids


class DDTreeModelRunner(DDTreeRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU model runner with DDTree (built by runner/worker.py)."""
