"""The V2 runner's tree sampler: the target's token at every node, the walk, compaction.

:class:`DDTreeV2Sampler` stands in for V2's rejection sampler. vLLM's own sampler gives
the target's token at every logits row (greedy, or a sample keyed by the node's
position: step line 4), then one graph replay walks every request's tree (step line 5)
and compacts the accepted paths (step line 6) so that vLLM's bookkeeping and the
drafter's next pass see a chain step with k accepted drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.config.model import PROCESSED_LOGPROBS_MODES
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

from vllm_ddtree.ops.walk import step_rows, walk_rows
from vllm_ddtree.runner.common import compact_accepted, compaction_slot_mappings
from vllm_ddtree.runner.v2_state import DDTreeV2State, split_outputs
from vllm_ddtree.sync import step_phase, to_device
from vllm_ddtree.tensors import TreeVerifyStep

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner



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

        if state.decode_only:
            key = (num_reqs, width, tokens.shape[0], exec_state is not None, len(touched))
            state.graphs_after.run(key, touched, launch)
        else:  # a prompt chunk in the step (DDTreeV2State.decode_only): run as it comes
            launch()
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
