"""The V2 model-runner side of a DDTree step (vLLM 0.33's ``vllm.v1.worker.gpu``).

The V2 runner keeps request state on the GPU and prepares each step's inputs
there, so nothing here reads device data on the host. The plugin steps in at
four points (patches._patch_v2_model_runner):

1. the speculator: :class:`~vllm_ddtree.speculator_v2.DDTreeSpeculator` drafts
   as V2's DFlash does and builds each request's tree in the same pass;
2. after ``prepare_attn`` (slot mappings are made from sequential positions
   there, so each node's KV goes to slot ``start + i``): the trees of the
   step, checked against the drafts the batch carries; verify rows get their
   depth positions and the ancestor masks go to the persistent mask buffer
   (:func:`begin_verify_step`); the target's attention metadata is built with
   the tree published (:func:`publish_for_build`);
3. the rejection sampler: :class:`DDTreeV2Sampler` takes the target's token at
   every node with V2's own sampler (greedy, or a sample keyed by the node's
   position), walks the trees, and compacts the accepted path (KV rows, hidden
   and aux hidden states, positions) so that vLLM's bookkeeping and the
   drafter's next pass see a chain step with k accepted drafts;
4. the drafter's pass over the same batch puts request i's tree in row i; the walk's
   graph in 3 has mapped request states to those rows already (after any other step
   the speculator maps them itself).

In engines with CUDA graphs, the launches of 2 and of the walk and compaction in 3
replay as one graph each per batch shape (step_graphs.py), over the step buffers
(:class:`StepBuffers`) and vLLM's persistent input buffers.

Requests whose sampling reads the drafts as a chain (repetition, frequency or
presence penalties, bad words, a thinking budget, custom logits processors) are verified as the
chain of their drafts; a batch with structured-output requests goes to vLLM's
own rejection sampler, as chains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.config.model import PROCESSED_LOGPROBS_MODES
from vllm.logger import init_logger
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

from vllm_ddtree.attention.state import (
    TreeAttentionInfo,
    causal_attention_info,
    mask_buffer,
    publishing,
)
from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.runner import (
    KVGroup,
    StepAttentionInfos,
    compact_accepted,
    compaction_slot_mappings,
    log_graph_coverage,
)
from vllm_ddtree.sampler import TreeVerifyStep
from vllm_ddtree.step_graphs import StepGraphs, enabled_by_env
from vllm_ddtree.step_tree_triton import step_trees_triton, tree_outputs
from vllm_ddtree.sync import step_phase, to_device
from vllm_ddtree.tree import DDTree
from vllm_ddtree.verify import WalkResult, step_rows, walk_buffers, walk_rows

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers


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


@dataclass
class DDTreeV2State:
    """Per-runner DDTree state, kept on the runner as ``runner.ddtree_state``."""

    ddtree: DDTreeConfig
    # Persistent packed ancestor masks, [max_num_reqs, budget + 1, words] int32:
    # the tree kernel in a full CUDA graph of the verify step reads them here.
    mask_buffer: torch.Tensor
    buffers: StepBuffers
    # The step's launches before the target (the trees) and after it (walk, compaction).
    graphs_before: StepGraphs
    graphs_after: StepGraphs
    # What the attention builders see of each step, its host side kept while the
    # batch's layout repeats.
    attn_infos: StepAttentionInfos = field(default_factory=StepAttentionInfos)
    step: TreeVerifyStep | None = None
    attn_info: TreeAttentionInfo | None = None
    # The step goes to vLLM's rejection sampler as chains (structured outputs).
    chain_only: bool = False
    # The step's ExecuteModelState (hidden states, slot mappings) while it is sampled.
    exec_state: Any = None
    # The target's KV-cache layers by group, found at the first compaction.
    kv_groups: list[KVGroup] | None = None
    compaction: str = ""  # how the last compaction ran, logged when it changes
    # The step kernels take the V2 runner's inputs (the warm-up compiles those variants).
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
        )


def install(runner: GPUModelRunner) -> None:
    """Turn a freshly built V2 model runner into a DDTree runner (no-op otherwise)."""
    ddtree = get_ddtree_config(runner.vllm_config)
    if ddtree is None:
        return
    from vllm_ddtree.attention import register_backends
    from vllm_ddtree.speculator_v2 import DDTreeSpeculator

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
    rows per request) a causal one, so that the graph holds the tree kernel, which
    then reads each replayed step's masks from the mask buffer."""
    if state.attn_info is not None or not for_capture:
        return state.attn_info
    width = state.ddtree.verify_width
    num_reqs = input_batch.num_reqs_after_padding
    query_start = input_batch.query_start_loc_np[: num_reqs + 1]
    if num_reqs == 0 or int(np.diff(query_start).max()) != width:
        return None
    return causal_attention_info(torch.from_numpy(query_start.astype(np.int32)), width,
                                 state.mask_buffer)


def begin_verify_step(runner: GPUModelRunner, input_batch: InputBatch) -> None:
    """Attach this step's trees to the batch and give verify rows their depth
    positions. Host sizes come from the batch's numpy copies; nothing waits for
    the device."""
    state: DDTreeV2State = runner.ddtree_state
    state.step = state.attn_info = None
    state.chain_only = False
    num_draft = input_batch.num_draft_tokens_per_req
    if input_batch.num_draft_tokens == 0 or num_draft is None:
        return
    num_reqs = input_batch.num_reqs
    num_draft = num_draft[:num_reqs].astype(np.int64)
    query_start = input_batch.query_start_loc_np[: num_reqs + 1].astype(np.int64)
    width = int(num_draft.max()) + 1
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

    if index is None or state_rows is not None:  # every input stays put: a graph replays
        state.graphs_before.run((num_reqs, width, index is None, input_ids.shape[0]),
                                (input_ids, query_start_loc, input_batch.positions), launch)
    else:  # the tree index of a mixed batch is made here, anew each step
        launch()
    state.step = TreeVerifyStep(tree=tree, num_scheduled=num_scheduled, row_start=row_start,
                                max_depth=state.ddtree.max_depth)
    state.attn_info = state.attn_infos(tree, query_start, num_draft, state.mask_buffer)


def _leading(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]``, without a slice where ``t`` has just ``n`` rows (a step's host work)."""
    return t if t.shape[0] == n else t[:n]


def tree_allowed(sampler, idx_mapping_np: np.ndarray) -> np.ndarray:
    """Per request (by state index): may it verify a tree? Not where a logits
    processor reads the drafts before a row as that row's history (penalties, bad
    words, a thinking budget; custom processors, whose reading is unknown): a tree's rows would see
    their preorder neighbours instead of their ancestors. vLLM marks each of those
    requests in ``needs_logits_processing`` (Sampler.add_request), so a batch with
    none marked is all trees without a look at each processor."""
    needs_processing = sampler.needs_logits_processing[idx_mapping_np]
    if not needs_processing.any():
        return np.ones(len(idx_mapping_np), dtype=bool)
    allowed = ~sampler.penalties_state.use_penalty[idx_mapping_np]
    thinking = getattr(sampler, "thinking_budget_state", None)
    if getattr(thinking, "enabled", False):  # counts thinking tokens in the drafts before a row
        allowed &= ~thinking.use_thinking_budget[idx_mapping_np]
    for proc in sampler.logits_processors:
        if isinstance(proc, BadWordsState):
            allowed &= proc.num_bad_words.np[idx_mapping_np] == 0
        elif not isinstance(proc, (LogitBiasState, PenaltiesState)):
            allowed &= ~needs_processing
    return allowed


class DDTreeV2Sampler:
    """Stands in for V2's ``RejectionSampler`` (same call); steps without trees, and
    chain-only steps, go to the one it replaces."""

    def __init__(self, runner: GPUModelRunner, chain_sampler) -> None:
        self.runner = runner
        self.chain_sampler = chain_sampler
        self.sampler = runner.sampler

    def __getattr__(self, name: str):  # e.g. enable_adaptive_verification (warm-up)
        chain_sampler = self.__dict__.get("chain_sampler")
        if chain_sampler is None:
            raise AttributeError(name)
        return getattr(chain_sampler, name)

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        state: DDTreeV2State = self.runner.ddtree_state
        step = state.step
        if step is None or state.chain_only or input_batch.num_draft_tokens == 0:
            return self.chain_sampler(logits, input_batch, draft_logits, invalid_drafts)
        sampler = self.sampler
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        logprobs_dims = sampler.get_logprobs_dims(input_batch.idx_mapping_np,
                                                  include_token_ids=False)
        # vLLM's sampler gives the target's token at every logits row. A tree node at
        # depth d sits at position root + d, so its sample is keyed (seed, position)
        # as the token at that position is in plain decoding.
        positions, input_ids = logits_row_inputs(input_batch)
        row_tokens, processed = sampler.sample(
            logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
            input_batch.idx_mapping_np, positions, input_ids, input_batch.expanded_local_pos,
            input_batch.seq_lens_cpu_upper_bound.numpy(),
            return_logprobs=logprobs_dims is not None,
        )
        with step_phase("ddtree.walk_compact", logits.device):
            sampled, num_sampled, num_rejected = self._walk_and_compact(
                row_tokens, input_batch, step)
        logprobs_tensors = None
        if logprobs_dims is not None:
            source = processed if sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
            rows = step_rows(input_batch.cu_num_logits[1 : input_batch.num_reqs + 1],
                             step.num_scheduled, sampled.shape[1])
            path_rows, path_tokens = _path_rows(rows, step.walk, sampled, input_batch)
            logprobs_tensors = compute_topk_scores(
                source[path_rows], logprobs_dims[0], path_tokens,
                input_batch.cu_num_logits_np.tolist(),
                logits_mode=sampler.logprobs_mode in ("raw_logits", "processed_logits"),
            )
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs_tensors,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def _walk_and_compact(self, row_tokens: torch.Tensor, input_batch: InputBatch,
                          step: TreeVerifyStep):
        """The walk over every request's tree, then the compaction of the accepted
        paths, as one graph replay once the shape has been met: (the output in chain
        format, tokens sampled and drafts rejected per request)."""
        state: DDTreeV2State = self.runner.ddtree_state
        num_reqs, width = input_batch.num_reqs, step.tree.tokens.shape[1]
        buffers = state.buffers.views(num_reqs, width)
        tokens = state.buffers.row_tokens[: row_tokens.numel()]
        tokens.copy_(row_tokens.view(-1), non_blocking=True)
        num_sampled, num_rejected = buffers.num_sampled, buffers.num_rejected
        step.walk = buffers.walk
        speculator = self.runner.speculator
        # vLLM's rule for requests still prefilling their prompt (they commit nothing).
        # prefill_len.gpu is one of a few UVA buffers that vLLM rotates as requests
        # arrive: like every tensor here that is not the runner's own, it is part of
        # the graph's signature.
        prefill_len = self.sampler.req_states.prefill_len.gpu
        chunked_prefill = (input_batch.seq_lens, buffers.idx_mapping, prefill_len)
        exec_state = state.exec_state
        touched = [input_batch.seq_lens, prefill_len]
        if exec_state is not None:
            states = [exec_state.hidden_states, *(exec_state.aux_hidden_states or [])]
            slot_mappings = exec_state.slot_mappings_by_layer
            touched += [*states, input_batch.input_ids, input_batch.positions,
                        *compaction_slot_mappings(self.runner, slot_mappings)]

        def launch() -> None:
            walk_rows(step.tree, tokens, buffers.cu_num_logits[1:], step.num_scheduled,
                      step.max_depth, num_sampled, num_rejected_out=num_rejected,
                      chunked_prefill=chunked_prefill, out=state.buffers.walk)
            if exec_state is not None:  # the accepted paths as chains, for vLLM and the drafter
                compact_accepted(self.runner, state, step, slot_mappings, states,
                                 input_batch.input_ids, input_batch.positions)
            # The drafter's pass over this batch, next, puts request i's tree in row i.
            speculator.map_batch(buffers.idx_mapping)

        key = (num_reqs, width, tokens.shape[0], exec_state is not None, len(touched))
        state.graphs_after.run(key, touched, launch)
        speculator.mapped_batch = input_batch
        # vLLM copies these to the host on another stream: copies of their own, which
        # the next step's replay does not overwrite (one launch for the three).
        return split_outputs(buffers.outputs.clone(), num_reqs, width)


def logits_row_inputs(input_batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, token id) of each logits row, the sampler's ``pos`` and
    ``input_ids``. In a step whose every query row is a logits row (each request
    verifying all it sent, the steady state) the logits rows are the token rows in
    order, and the batch's own leading rows serve, with no gather."""
    num_reqs = input_batch.num_reqs
    num_logits = int(input_batch.cu_num_logits_np[num_reqs])
    if num_logits == int(input_batch.query_start_loc_np[num_reqs]):
        return input_batch.positions[:num_logits], input_batch.input_ids[:num_logits]
    indices = input_batch.logits_indices
    return input_batch.positions[indices], input_batch.input_ids[indices]


def _path_rows(rows: torch.Tensor, walk, sampled: torch.Tensor, input_batch: InputBatch):
    """For each logits row of the batch (request r, local slot j): the logits row of
    the j-th node on r's accepted path (past the path: r's last row) and the token
    drawn there (``sampled[r, j]``, 0 past the output)."""
    num_reqs, width = rows.shape
    path = walk.accepted_nodes[:, :width]
    if path.shape[1] < width:
        path = torch.cat([path, path.new_full((num_reqs, width - path.shape[1]), -1)], dim=1)
    path_rows = torch.where(path >= 0, rows.gather(1, path.clamp(min=0)), rows[:, -1:])
    counts = np.diff(input_batch.cu_num_logits_np[: num_reqs + 1])
    req = to_device(torch.from_numpy(np.repeat(np.arange(num_reqs), counts)), rows.device)
    slot = input_batch.expanded_local_pos.to(torch.int64)
    return path_rows[req, slot], sampled[req, slot].clamp(min=0)
