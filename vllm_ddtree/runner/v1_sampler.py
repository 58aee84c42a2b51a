"""Tree sampling: the DDTree replacement for vLLM's chain rejection sampler.

For every node of every request's tree the target's token is drawn from the
target distribution at that node (argmax when greedy, a sample after vLLM's
processing when T > 0); the walk then follows matching children from the root.
Each committed token is a target sample at the correct prefix, so the output
has the target distribution at any temperature ("sample and match").

The result is in vLLM's chain format ``[num_reqs, max_spec_len + 1]``:
accepted tokens, the bonus token, then -1, so the scheduler, detokenizer,
stop handling and metrics need no tree knowledge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor import builtin as builtin_procs
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_ddtree.ops.step_trees import chain_step
from vllm_ddtree.ops.walk import step_rows, walk_tree
from vllm_ddtree.sync import step_phase
from vllm_ddtree.tensors import TreeVerifyStep, WalkResult

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers

PLACEHOLDER_TOKEN_ID = -1


class DDTreeSampler(nn.Module):
    """Drop-in for ``RejectionSampler`` when the drafts form a tree."""

    def __init__(self, sampler: Sampler, get_step) -> None:
        super().__init__()
        self.sampler = sampler
        # Returns the TreeVerifyStep of the step being sampled.
        self._get_step = get_step

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,  # unused: trees are verified by matching
        logits: torch.Tensor,  # [num_reqs + num_draft_tokens, vocab]
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        with step_phase("ddtree.sample_walk", logits.device):
            return self._forward(metadata, logits, sampling_metadata)

    def _forward(
        self,
        metadata: SpecDecodeMetadata,
        logits: torch.Tensor,  # [num_reqs + num_draft_tokens, vocab]
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        step: TreeVerifyStep | None = self._get_step()
        width = metadata.max_spec_len + 1
        if step is None:  # e.g. vLLM's dummy sampler run: verify as chains
            step = chain_step(metadata, logits.device)
        num_reqs = step.num_scheduled.shape[0]
        if step.tree.tokens.shape[1] != width:
            raise RuntimeError(
                f"the step's trees have {step.tree.tokens.shape[1]} nodes per request, but "
                f"{width - 1} drafts per request were verified"
            )
        # Flat logits row of node i of request r (clamped for absent nodes).
        rows = step_rows(metadata.cu_num_sampled_tokens, step.num_scheduled, width)
        processed = process_logits(logits, rows, step, sampling_metadata)
        node_tokens = sample_node_tokens(processed, rows, sampling_metadata,
                                         [n + 1 for n in metadata.num_draft_tokens])
        # Nodes past a request's scheduled count are already invalid (TreeVerifyStep).
        walk = walk_tree(step.tree, node_tokens, step.max_depth)
        step.walk = walk
        output = walk.output_tokens[:, :width].to(torch.int32)

        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs_tensors = self._logprobs(
                sampling_metadata.max_num_logprobs,
                logits,
                processed,
                rows,
                walk,
                output,
            )
        assert output.shape == (num_reqs, width)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs_tensors)

    def _logprobs(
        self,
        max_num_logprobs: int,
        logits: torch.Tensor,
        processed: torch.Tensor,
        rows: torch.Tensor,
        walk: WalkResult,
        output: torch.Tensor,
    ) -> LogprobsTensors:
        # Output token j was drawn at the j-th node of the accepted path.
        width = output.shape[1]
        path = walk.accepted_nodes[:, :width].clamp(min=0)
        if path.shape[1] < width:
            pad = path[:, -1:].expand(-1, width - path.shape[1])
            path = torch.cat([path, pad], dim=1)
        flat_rows = torch.gather(rows, 1, path).flatten()
        mode = self.sampler.logprobs_mode
        source = processed if mode.startswith("processed") else logits.float()
        chosen = source[flat_rows]
        if not mode.endswith("logits"):
            chosen = self.sampler.compute_logprobs(chosen)
        tokens = output.flatten().to(torch.int64).clamp(min=0)
        return self.sampler.gather_logprobs(chosen, max_num_logprobs, tokens)


def process_logits(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows: torch.Tensor,  # [num_reqs, width]
    step: TreeVerifyStep,
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """vLLM's logits processing at every tree node, in float32 (a greedy batch with
    nothing to apply and no logprobs gets its raw logits back).

    Per-request processors (logit bias, min tokens, min-p, custom ones) act on
    one ``[num_reqs, vocab]`` slice per node column; penalties see each node's
    own ancestors as already generated. With nothing to apply (a plain greedy
    or sampled batch) the float32 logits come back as they are, uncopied.
    """
    num_reqs, width = rows.shape
    procs = list(sampling_metadata.logitsprocs.non_argmax_invariant)
    if not sampling_metadata.all_greedy:
        procs += list(sampling_metadata.logitsprocs.argmax_invariant)
    procs = [proc for proc in procs if not _idle(proc)]
    masked = sampling_metadata.allowed_token_ids_mask is not None
    if not (masked or procs or not sampling_metadata.no_penalties):
        # Nothing to apply. A greedy batch without logprobs only takes argmaxes,
        # which the raw logits give alike (the float32 cast is exact and monotone):
        # no [num_rows, vocab] float32 copy.
        if sampling_metadata.all_greedy and sampling_metadata.max_num_logprobs is None:
            return logits
        return logits.float()
    out = logits.float()
    if out is logits:
        out = out.clone()  # edited in place below; the caller's logits stay raw
    if masked or not sampling_metadata.no_penalties:
        req_of_row = _request_of_row(rows, out.shape[0])
    if masked:
        mask = sampling_metadata.allowed_token_ids_mask[:num_reqs][req_of_row]
        out.masked_fill_(mask, float("-inf"))
    if not sampling_metadata.no_penalties:
        out = _apply_tree_penalties(out, rows, req_of_row, step, sampling_metadata)
    for col in range(width if procs else 0):
        # Absent nodes repeat their request's last row: leave those rows as
        # they are, so no row is processed twice.
        col_rows = rows[:, col]
        original = out[col_rows]
        block = original.clone()
        for proc in procs:
            block = proc.apply(block)
        present = (col <= step.num_scheduled)[:, None]
        out[col_rows] = torch.where(present, block, original)
    return out


# vLLM's built-in processors and the state that is empty while no request of the
# batch uses them (their ``apply`` then returns the logits untouched).
_IDLE_WHEN_EMPTY = (
    (builtin_procs.MinPLogitsProcessor, "min_p_count"),
    (builtin_procs.LogitBiasLogitsProcessor, "biases"),
    (builtin_procs.MinTokensLogitsProcessor, "min_toks"),
)


def _idle(proc) -> bool:
    """A built-in processor no request of the batch uses: applying it changes
    nothing, and skipping it saves a gather, a copy and a scatter per tree column.
    Other (custom) processors always run."""
    return any(
        type(proc) is cls and not getattr(proc, state, True) for cls, state in _IDLE_WHEN_EMPTY
    )


def sample_node_tokens(
    processed: torch.Tensor,  # [num_rows, vocab] float32 (raw: greedy, nothing applied)
    rows: torch.Tensor,  # [num_reqs, width]
    sampling_metadata: SamplingMetadata,
    num_nodes: list[int] | None = None,  # per request, root included; None: width each
) -> torch.Tensor:
    """The target's token at every node, ``[num_reqs, width]``."""
    if sampling_metadata.all_greedy:
        return processed.argmax(dim=-1)[rows]
    num_reqs = rows.shape[0]
    req_of_row = _request_of_row(rows, processed.shape[0])
    temperature = sampling_metadata.temperature[:num_reqs].float()
    is_greedy = temperature <= 0
    scaled = processed / torch.where(is_greedy, 1.0, temperature)[req_of_row, None]
    top_k = sampling_metadata.top_k
    top_p = sampling_metadata.top_p
    scaled = apply_top_k_top_p(
        scaled,
        None if top_k is None else top_k[:num_reqs][req_of_row],
        None if top_p is None else top_p[:num_reqs][req_of_row],
    )
    probs = scaled.softmax(dim=-1, dtype=torch.float32)
    # One uniform per node, then the inverse CDF: a row's whole vocabulary is scanned
    # once (cumsum) instead of raced against as many random numbers (an exponential
    # race), whose generation dominated the sampler on a CPU.
    uniforms = torch.rand(probs.shape[0], device=probs.device)
    # A seeded request draws one uniform per node from its own generator, so its stream
    # depends on its own tree only. Its nodes are the first num_nodes[req] columns
    # (the rest repeat its last row), counted on the host: no device-side count.
    for req, generator in sampling_metadata.generators.items():
        if req < num_reqs:
            count = rows.shape[1] if num_nodes is None else num_nodes[req]
            uniforms[rows[req, :count]] = torch.rand(
                count, device=probs.device, generator=generator
            )
    sampled = inverse_cdf_sample(probs, uniforms)
    if sampling_metadata.all_random:  # no greedy request: no argmax pass
        return sampled[rows]
    tokens = torch.where(is_greedy[req_of_row], processed.argmax(dim=-1), sampled)
    return tokens[rows]


def inverse_cdf_sample(
    probs: torch.Tensor,  # [num_rows, vocab] float32, each row >= 0 with a positive sum
    uniforms: torch.Tensor,  # [num_rows] in [0, 1)
) -> torch.Tensor:  # [num_rows] int64
    """The token of each row whose cumulative probability first exceeds ``u`` times
    the row's total: a sample from the row when ``u`` is uniform. Never a token of
    probability zero (the cumulative sum does not rise there), never past the end."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    below_total = torch.nextafter(total, torch.zeros_like(total))  # u * total < total
    target = torch.minimum(uniforms[:, None] * total, below_total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _request_of_row(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request index of every flat row, ``[num_rows]``."""
    owner = torch.zeros(num_rows, dtype=torch.int64, device=rows.device)
    req = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
    owner[rows.flatten()] = req.flatten()
    return owner


def _apply_tree_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    req_of_row: torch.Tensor,
    step: TreeVerifyStep,
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """Penalties at each node count that node's ancestors as generated."""
    num_reqs, width = rows.shape
    tokens = step.tree.tokens[:, :width].tolist()
    parents = step.tree.parents[:, :width].tolist()
    num_rows = logits.shape[0]
    histories: list[list[int]] = [[] for _ in range(num_rows)]
    flat_rows = rows.tolist()
    num_scheduled = step.num_scheduled.tolist()
    for r in range(num_reqs):
        base = sampling_metadata.output_token_ids[r]
        paths: list[list[int]] = [[]]
        for i in range(1, num_scheduled[r] + 1):
            paths.append(paths[parents[r][i]] + [tokens[r][i]])
        for i, path in enumerate(paths):
            histories[flat_rows[r][i]] = base + path
    prompt = sampling_metadata.prompt_token_ids[req_of_row]
    return apply_all_penalties(
        logits,
        prompt,
        sampling_metadata.presence_penalties[req_of_row],
        sampling_metadata.frequency_penalties[req_of_row],
        sampling_metadata.repetition_penalties[req_of_row],
        histories,
    )
