"""DDTree on vLLM's V2 model runner (vLLM 0.33's ``vllm.v1.worker.gpu``, its GPU default).

The V2 runner keeps request state on the GPU and prepares each step's inputs there,
so nothing here reads device data on the host. :class:`DDTreeV2ModelRunner` overrides
the runner's methods where a line of the step (``ops/step.py``) happens:

1-2. draft, build the tree: the speculator is a
     :class:`~vllm_ddtree.runner.v2_speculator.DDTreeSpeculator`, which builds each
     request's tree inside V2's DFlash pass (vLLM's ``init_speculator``, patched for
     DDTree engines: patches.py);
3.   verify: after ``prepare_attn`` (slot mappings come from sequential positions, so
     node i's KV goes to slot ``start + i``), :func:`begin_verify_step` checks the
     step's trees against the drafts the batch carries, gives verify rows their depth
     positions and writes the ancestor masks into the persistent mask buffer; the
     target's attention metadata is built with the tree published
     (:func:`publish_for_build`);
4-6. the rejection sampler is a :class:`~vllm_ddtree.runner.v2_sampler.DDTreeV2Sampler`:
     the target's token at every node, the walk, the compaction of the accepted path.

In engines with CUDA graphs, the launches of line 3 and of lines 5-6 replay as one graph
each per batch shape (step_graphs.py), over the step buffers (runner/v2_state.py) and
vLLM's persistent input buffers.

Requests whose sampling reads the drafts as a chain (repetition, frequency or presence
penalties, bad words, a thinking budget, custom logits processors) verify their drafts
as a chain; a batch with structured-output requests goes to vLLM's own rejection
sampler, as chains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from vllm_ddtree.attention.state import (
    TreeAttentionInfo,
    causal_attention_info,
    publishing,
)
from vllm_ddtree.config import get_ddtree_config, tree_sizes
from vllm_ddtree.kernels.step_trees import step_trees_triton
from vllm_ddtree.runner.common import (
    check_tree_backends,
    log_graph_coverage,
    warm_up_kernels,
)
from vllm_ddtree.runner.step_graphs import StepGraphs, enabled_by_env
from vllm_ddtree.runner.v2_sampler import DDTreeV2Sampler, tree_allowed
from vllm_ddtree.runner.v2_state import DDTreeV2State
from vllm_ddtree.sync import step_phase, to_device
from vllm_ddtree.tensors import (
    TreeVerifyStep,
)

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.input_batch import InputBatch

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers


def install(runner: GPUModelRunner) -> None:
    """Make a freshly built V2 model runner a DDTree runner (its state), after checking
    that the engine asks for nothing DDTree's V2 path lacks."""
    ddtree = get_ddtree_config(runner.vllm_config)
    if ddtree is None:
        raise ValueError("a DDTree model runner needs a DDTree speculative config")
    from vllm_ddtree.attention import register_backends
    from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator

    spec = runner.speculative_config
    unsupported = [name for name, on in (
        ("M-RoPE target models", runner.model_config.uses_mrope),
        (f"rejection_sample_method={spec.rejection_sample_method!r}",
         spec.rejection_sample_method != "standard"),
        (f"draft_sample_method={spec.draft_sample_method!r}",
         spec.draft_sample_method != "greedy"),
        ("pipeline parallelism", runner.use_pp),
        ("adaptive verification", spec.enable_adaptive_verification),
        ("watermarking", getattr(runner.vllm_config, "watermark_config", None) is not None),
    ) if on]
    if unsupported:
        raise NotImplementedError(
            f"DDTree on vLLM's V2 model runner does not support {', '.join(unsupported)} "
            "yet; run it on the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0)."
        )
    if not isinstance(runner.speculator, DDTreeSpeculator):
        raise RuntimeError(
            f"the V2 runner built {type(runner.speculator).__name__} for a DDTree config; "
            "vllm_ddtree's init_speculator patch is not in place"
        )
    register_backends(runner.device)
    graphs = (not runner.model_config.enforce_eager and enabled_by_env()
              and runner.compilation_config.cudagraph_mode != CUDAGraphMode.NONE)
    runner.ddtree_state = DDTreeV2State.create(ddtree, runner.max_num_reqs,
                                               runner.max_num_tokens, runner.device, graphs)
    runner.ddtree_state.verify_widths |= {k + 1 for k in tree_sizes(runner.vllm_config) if k}
    # The speculator's own launches between replays (v2_speculator.py), as graphs too.
    speculator = runner.speculator
    speculator.sizing_graphs = StepGraphs(runner.device, "tree sizing", graphs,
                                          shared_pool=True)
    speculator.context_graphs = StepGraphs(runner.device, "drafter context", graphs,
                                           shared_pool=True)
    logger.info("DDTree on the V2 model runner: verify width %d, drafter width %d.",
                ddtree.verify_width, ddtree.drafter_width)
    log_graph_coverage(runner.vllm_config, ddtree)


def after_load_model(runner: GPUModelRunner) -> None:
    """Once the samplers and the model state exist: the tree sampler in place of
    vLLM's rejection sampler, and the tree published while the target's attention
    metadata is built."""
    state: DDTreeV2State = runner.ddtree_state
    runner.rejection_sampler = DDTreeV2Sampler(runner, runner.rejection_sampler)
    model_state = runner.model_state
    build = model_state.prepare_attn

    def prepare_attn(input_batch, *args, **kwargs):
        with publishing(publish_for_build(state, input_batch, kwargs.get("for_capture", False))):
            return build(input_batch, *args, **kwargs)

    model_state.prepare_attn = prepare_attn


def publish_for_build(
    state: DDTreeV2State, input_batch: InputBatch, for_capture: bool
) -> TreeAttentionInfo | None:
    """The tree to publish while the target's attention metadata is built: this
    step's, or for the capture of a full CUDA graph of verify shape (``budget + 1``
    rows per request, or ``k + 1`` for each size k a step may verify) a causal one, so
    that the graph holds the tree kernel, which
    then reads each replayed step's masks from the mask buffer."""
    if state.attn_info is not None or not for_capture:
        return state.attn_info
    num_reqs = input_batch.num_reqs_after_padding
    query_start = input_batch.query_start_loc_np[: num_reqs + 1]
    width = int(np.diff(query_start).max()) if num_reqs else 0
    if width not in state.verify_widths:  # one per tree size where sizes vary per step
        return None
    return causal_attention_info(torch.from_numpy(query_start.astype(np.int32)), width,
                                 state.mask_buffer)


def begin_verify_step(runner: GPUModelRunner, input_batch: InputBatch) -> None:
    """Attach this step's trees to the batch and give verify rows their depth
    positions. Host sizes come from the batch's numpy copies; nothing waits for
    the device."""
    state: DDTreeV2State = runner.ddtree_state
    state.step = state.attn_info = None
    state.chain_only = state.decode_only = False
    num_draft = input_batch.num_draft_tokens_per_req
    if input_batch.num_draft_tokens == 0 or num_draft is None:
        return
    num_reqs = input_batch.num_reqs
    num_draft = num_draft[:num_reqs].astype(np.int64)
    query_start = input_batch.query_start_loc_np[: num_reqs + 1].astype(np.int64)
    width = int(num_draft.max()) + 1
    state.decode_only = bool((np.diff(query_start) == num_draft + 1).all())
    # Which requests may verify their tree: the rest verify their drafts as a chain.
    state.chain_only = bool(input_batch.has_structured_output_reqs)
    allowed = np.zeros(num_reqs, dtype=bool) if state.chain_only else \
        tree_allowed(runner.sampler, input_batch.idx_mapping_np[:num_reqs])
    # vLLM makes these two anew each step; the step's launches read copies that stay put.
    buffers = state.buffers.views(num_reqs, width)
    idx_mapping, cu_num_logits = buffers.idx_mapping, buffers.cu_num_logits
    idx_mapping.copy_(_leading(input_batch.idx_mapping, num_reqs), non_blocking=True)
    cu_num_logits.copy_(_leading(input_batch.cu_num_logits, num_reqs + 1), non_blocking=True)
    speculator = runner.speculator
    trees = index = state_rows = None
    if allowed.all():  # the launch maps each request's state to its tree row
        trees, index, state_rows = speculator.trees, idx_mapping, speculator.tree_row_of_state
    elif allowed.any():
        rows = speculator.tree_row_of_state[idx_mapping]
        mask = to_device(torch.from_numpy(allowed), runner.device)
        trees, index = speculator.trees, torch.where(mask, rows, -1)
    # Drafts per request come from the logits rows (one per draft, plus the bonus).
    num_scheduled, tree, row_start = buffers.num_scheduled, buffers.tree, buffers.row_start
    input_ids, query_start_loc = input_batch.input_ids, input_batch.query_start_loc

    def launch() -> None:
        # Node i of a request sits at start + depth_i (its KV slot stays start + i); the
        # masks are packed straight into the buffer the tree kernel reads.
        step_trees_triton(
            trees, index, input_ids, query_start_loc[1 : num_reqs + 1], num_scheduled,
            width, packed_out=state.mask_buffer, positions=input_batch.positions,
            query_start_loc=query_start_loc, row_start_out=row_start, state_rows=state_rows,
            cu_num_logits=cu_num_logits, out=state.buffers.trees,
        )

    if state.decode_only and (index is None or state_rows is not None):
        # every input stays put and the token count follows the batch: a graph replays
        state.graphs_before.run((num_reqs, width, index is None, input_ids.shape[0]),
                                (input_ids, query_start_loc, input_batch.positions), launch)
    else:  # a prompt chunk in the step, or a tree index made here anew each step
        launch()
    state.step = TreeVerifyStep(tree=tree, num_scheduled=num_scheduled, row_start=row_start,
                                max_depth=state.ddtree.max_depth)
    state.attn_info = state.attn_infos(tree, query_start, num_draft, state.mask_buffer)


def _leading(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]``, without a slice where ``t`` has just ``n`` rows (a step's host work)."""
    return t if t.shape[0] == n else t[:n]


class DDTreeV2ModelRunner(GPUModelRunner):
    """vLLM's V2 model runner with DDTree (built by runner/worker.py). Each override calls
    vLLM's method and adds one line of the step."""

    ddtree_state: DDTreeV2State

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # builds the DDTreeSpeculator: lines 1-2
        install(self)

    def load_model(self, *args: Any, **kwargs: Any):
        result = super().load_model(*args, **kwargs)
        after_load_model(self)  # the tree sampler (lines 4-6); the tree published (3)
        return result

    def initialize_kv_cache(self, *args: Any, **kwargs: Any):
        result = super().initialize_kv_cache(*args, **kwargs)
        check_tree_backends(self)  # every target layer has tree attention (line 3)
        warm_up_kernels(self)
        return result

    def prepare_attn(self, input_batch: InputBatch):
        result = super().prepare_attn(input_batch)
        with step_phase("ddtree.begin_verify", self.device):
            begin_verify_step(self, input_batch)  # line 3: depth positions, masks
        return result

    def sample_tokens(self, *args: Any, **kwargs: Any):
        state = self.ddtree_state
        state.exec_state = self.execute_model_state  # what compaction moves (line 6)
        try:
            return super().sample_tokens(*args, **kwargs)
        finally:
            state.exec_state = state.step = state.attn_info = None
