"""Tree sampling: the DDTree replacement for vLLM's chain rejection sampler.

For every node of every request's tree the target's token is drawn from the
target distribution at that node (argmax when greedy, a sample after vLLM's
processing when T > 0); the walk then follows matching children from the root.
Each committed token is a target sample at the correct prefix, so the output
has the target distribution at any temperature ("sample and match").

A node is the next-token position of its own branch, so each node gets what vLLM's
plain sampler would apply there: bad words and penalties read the request's output
followed by the node's ancestors, min-tokens counts the node's depth, the steps come
in vLLM's order, and on the CPU a node at depth d draws with the seed plain decoding
uses d tokens ahead. Greedy and seeded requests thus give plain decoding's tokens.
Every request goes through here, its first token too (a step without drafts).

The result is in vLLM's chain format ``[num_reqs, max_spec_len + 1]``:
accepted tokens, the bonus token, then -1, so the scheduler, detokenizer,
stop handling and metrics need no tree knowledge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor import builtin as builtin_procs
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p

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
# vLLM's CPU draw, which NodeSeeds reproduces at every tree node.
_PLAIN_CPU_DRAW = getattr(TopKTopPSampler, "forward_cpu", None)


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
        num_nodes = [n + 1 for n in metadata.num_draft_tokens]
        seeds = None
        if not sampling_metadata.all_greedy and self._draws_like_plain_cpu(logits):
            seeds = NodeSeeds.draw(sampling_metadata.generators, rows, step.tree.depths,
                                   num_nodes, logits.shape[0])
        node_tokens = sample_node_tokens(processed, rows, sampling_metadata, num_nodes,
                                         None if seeds is None else seeds.seeds)
        # Nodes past a request's scheduled count are already invalid (TreeVerifyStep).
        walk = walk_tree(step.tree, node_tokens, step.max_depth)
        step.walk = walk
        if seeds is not None:  # each seeded generator as plain decoding leaves it
            seeds.rewind(sampling_metadata.generators, (walk.num_accepted + 1).tolist())
        output = walk.output_tokens[:, :width].to(torch.int32)

        logprobs_tensors = None
        token_ids = getattr(sampling_metadata, "logprob_token_ids", None)
        if sampling_metadata.max_num_logprobs is not None or token_ids:
            logprobs_tensors = self._logprobs(
                sampling_metadata.max_num_logprobs,
                token_ids,
                logits,
                processed,
                rows,
                walk,
                output,
            )
        assert output.shape == (num_reqs, width)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs_tensors)

    def _draws_like_plain_cpu(self, logits: torch.Tensor) -> bool:
        """Whether vLLM's sampler here draws as its CPU path does (a gumbel-max draw
        keyed by one seed per step): then the tree draws so too, token for token."""
        sampler = getattr(self.sampler, "topk_topp_sampler", None)
        if logits.device.type != "cpu" or sampler is None or _PLAIN_CPU_DRAW is None:
            return False
        try:
            torch.ops._C.fused_gumbel_argmax  # noqa: B018 (vLLM's CPU kernel is loaded)
        except (AttributeError, RuntimeError):
            return False
        return (not sampler.use_fp64_gumbel
                and getattr(sampler.forward, "__func__", None) is _PLAIN_CPU_DRAW)

    def _logprobs(
        self,
        max_num_logprobs: int | None,
        token_ids: dict[int, list[int]] | None,  # request -> the ids to score, if any
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
        if token_ids:  # as vLLM's sampler: these ids' logprobs in place of the top ones
            by_row = {r * width + j: ids for r, ids in token_ids.items()
                      if r < output.shape[0] for j in range(width)}
            return self.sampler.gather_specific_token_logprobs(chosen, by_row, tokens)
        return self.sampler.gather_logprobs(chosen, max_num_logprobs, tokens)


def process_logits(
    logits: torch.Tensor,  # [num_rows, vocab]
    rows: torch.Tensor,  # [num_reqs, width]
    step: TreeVerifyStep,
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """What vLLM applies before its greedy argmax, at every tree node, in vLLM's
    order: allowed-token mask, bad words, the processors that can move the argmax
    (logit bias, min tokens, custom ones), penalties. In float32; a greedy batch with
    nothing to apply and no logprobs gets its raw logits back, uncopied.

    Bad words and penalties read each node's own ancestors as the tokens generated
    after the request's output so far; the per-request processors act on one
    ``[num_reqs, vocab]`` slice per node column. Temperature and the processors that
    cannot move the argmax (min-p) come later, in :func:`sample_node_tokens`.
    """
    num_reqs = rows.shape[0]
    procs = _active(sampling_metadata.logitsprocs.non_argmax_invariant)
    masked = sampling_metadata.allowed_token_ids_mask is not None
    bad_words = {r: words for r, words in sampling_metadata.bad_words_token_ids.items()
                 if r < num_reqs}
    penalties = not sampling_metadata.no_penalties
    if not (masked or bad_words or procs or penalties):
        # Nothing to apply. A greedy batch without logprobs only takes argmaxes,
        # which the raw logits give alike (the float32 cast is exact and monotone):
        # no [num_rows, vocab] float32 copy.
        if sampling_metadata.all_greedy and sampling_metadata.max_num_logprobs is None:
            return logits
        return logits.float()
    out = logits.float()
    if out is logits:
        out = out.clone()  # edited in place below; the caller's logits stay raw
    if masked or penalties:
        req_of_row = _request_of_row(rows, out.shape[0])
    if masked:
        mask = sampling_metadata.allowed_token_ids_mask[:num_reqs][req_of_row]
        out.masked_fill_(mask, float("-inf"))
    if bad_words:
        _apply_tree_bad_words(out, rows, step, bad_words, sampling_metadata.output_token_ids)
    for proc in procs:  # in vLLM's order
        if type(proc) is builtin_procs.MinTokensLogitsProcessor:
            _apply_tree_min_tokens(out, rows, step, proc)
        else:
            out = _apply_per_column(out, rows, step.num_scheduled + 1, [proc])
    if penalties:
        out = _apply_tree_penalties(out, rows, req_of_row, step, sampling_metadata)
    return out


def _apply_per_column(
    logits: torch.Tensor,  # [num_rows, vocab] float32, edited in place
    rows: torch.Tensor,  # [num_reqs, width]
    num_nodes: torch.Tensor,  # [num_reqs], root included
    procs: list,
) -> torch.Tensor:
    """vLLM's per-request processors, which take one ``[num_reqs, vocab]`` block (row r
    = request r), once per tree column. Absent nodes repeat their request's last row:
    those rows are left as they are, so no row is processed twice."""
    for col in range(rows.shape[1]):
        col_rows = rows[:, col]
        original = logits[col_rows]
        block = original.clone()
        for proc in procs:
            block = proc.apply(block)
        present = (col < num_nodes)[:, None]
        logits[col_rows] = torch.where(present, block, original)
    return logits


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


def _active(procs) -> list:
    """The processors of ``procs`` that some request of the batch uses."""
    return [proc for proc in procs if not _idle(proc)]


def sample_node_tokens(
    processed: torch.Tensor,  # [num_rows, vocab] float32 (raw: greedy, nothing applied)
    rows: torch.Tensor,  # [num_reqs, width]
    sampling_metadata: SamplingMetadata,
    num_nodes: list[int] | None = None,  # per request, root included; None: width each
    seeds: torch.Tensor | None = None,  # [num_rows] int64: draw as vLLM's CPU path does
) -> torch.Tensor:
    """The target's token at every node, ``[num_reqs, width]``: the argmax of the
    processed logits for a greedy request; for a sampled one, as vLLM's sampler
    draws: temperature, then min-p (and any other processor that cannot move the
    argmax), then top-k and top-p, then a draw: with ``seeds``, vLLM's CPU draw (a
    gumbel-max keyed by the row's seed: :class:`NodeSeeds`), else the inverse CDF
    of one uniform per node."""
    if sampling_metadata.all_greedy:
        return processed.argmax(dim=-1)[rows]
    num_reqs, width = rows.shape
    req_of_row = _request_of_row(rows, processed.shape[0])
    temperature = sampling_metadata.temperature[:num_reqs].float()
    is_greedy = temperature <= 0
    scaled = processed / torch.where(is_greedy, 1.0, temperature)[req_of_row, None]
    procs = _active(sampling_metadata.logitsprocs.argmax_invariant)
    if procs:
        counts = torch.tensor([width] * num_reqs if num_nodes is None else num_nodes,
                              device=rows.device)
        scaled = _apply_per_column(scaled, rows, counts, procs)
    top_k = sampling_metadata.top_k
    top_p = sampling_metadata.top_p
    scaled = apply_top_k_top_p(
        scaled,
        None if top_k is None else top_k[:num_reqs][req_of_row],
        None if top_p is None else top_p[:num_reqs][req_of_row],
    )
    if seeds is not None:
        sampled = torch.ops._C.fused_gumbel_argmax(scaled.float().contiguous(), seeds)
    else:
        sampled = _inverse_cdf_draw(scaled, rows, sampling_metadata.generators, num_nodes)
    if sampling_metadata.all_random:  # no greedy request: no argmax pass
        return sampled[rows]
    tokens = torch.where(is_greedy[req_of_row], processed.argmax(dim=-1), sampled)
    return tokens[rows]


def _inverse_cdf_draw(
    scaled: torch.Tensor,  # [num_rows, vocab] float32, processed and filtered
    rows: torch.Tensor,  # [num_reqs, width]
    generators: dict[int, torch.Generator],
    num_nodes: list[int] | None,
) -> torch.Tensor:  # [num_rows] int64
    num_reqs, width = rows.shape
    probs = scaled.softmax(dim=-1, dtype=torch.float32)
    # One uniform per node, then the inverse CDF: a row's whole vocabulary is scanned
    # once (cumsum) instead of raced against as many random numbers (an exponential
    # race), whose generation dominated the sampler on a CPU.
    uniforms = torch.rand(probs.shape[0], device=probs.device)
    # A seeded request draws one uniform per node from its own generator, so its stream
    # depends on its own tree only. Its nodes are the first num_nodes[req] columns
    # (the rest repeat its last row), counted on the host: no device-side count.
    for req, generator in generators.items():
        if req < num_reqs:
            count = width if num_nodes is None else num_nodes[req]
            uniforms[rows[req, :count]] = torch.rand(
                count, device=probs.device, generator=generator
            )
    return inverse_cdf_sample(probs, uniforms)


@dataclass
class NodeSeeds:
    """vLLM's CPU sampler draws one seed per step from a seeded request's generator
    and samples that step's token with it. A node at depth d proposes the d-th token
    from now, so it takes the d-th seed from now (siblings share one), and after the
    walk each generator is put back to where it stands after the committed tokens'
    draws: a seeded request then gives plain decoding's tokens, and the node samples
    stay exact (the seed at depth d is independent of the path chosen above it)."""

    seeds: torch.Tensor  # [num_rows] int64; unseeded requests' rows: fresh random seeds
    states: dict[int, list[torch.Tensor]]  # request -> generator state before each depth's draw

    @classmethod
    def draw(
        cls,
        generators: dict[int, torch.Generator],
        rows: torch.Tensor,  # [num_reqs, width]
        depths: torch.Tensor,  # [num_reqs, >= width] int64, the tree's
        num_nodes: list[int],  # per request, root included
        num_rows: int,
    ) -> NodeSeeds:
        seeds = torch.randint(0, 2**31, (num_rows,), dtype=torch.long)
        states: dict[int, list[torch.Tensor]] = {}
        for req, generator in generators.items():
            if req >= rows.shape[0]:
                continue
            node_depths = depths[req, : num_nodes[req]].cpu()
            before, by_depth = [], []
            for _ in range(int(node_depths.max()) + 1):
                before.append(generator.get_state())
                by_depth.append(torch.randint(0, 2**31, (1,), generator=generator,
                                              dtype=torch.long).item())
            seeds[rows[req, : num_nodes[req]].cpu()] = torch.tensor(by_depth)[node_depths]
            states[req] = before
        return cls(seeds=seeds.to(rows.device), states=states)

    def rewind(self, generators: dict[int, torch.Generator], num_committed: list[int]) -> None:
        """Leave each seeded generator as plain decoding would after ``num_committed``
        tokens (one draw each)."""
        for req, before in self.states.items():
            if num_committed[req] < len(before):
                generators[req].set_state(before[num_committed[req]])


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


def _node_paths(step: TreeVerifyStep, rows: torch.Tensor, reqs) -> dict[int, list[list[int]]]:
    """For each request of ``reqs``: the tokens on the way from the root to each of its
    sent nodes (root excluded; the root's own path is empty), in node order."""
    width = rows.shape[1]
    tokens = step.tree.tokens[:, :width].tolist()
    parents = step.tree.parents[:, :width].tolist()
    num_scheduled = step.num_scheduled.tolist()
    paths = {}
    for r in reqs:
        node_paths: list[list[int]] = [[]]
        for i in range(1, num_scheduled[r] + 1):
            node_paths.append(node_paths[parents[r][i]] + [tokens[r][i]])
        paths[r] = node_paths
    return paths


def _apply_tree_bad_words(
    logits: torch.Tensor,  # [num_rows, vocab] float32, edited in place
    rows: torch.Tensor,  # [num_reqs, width]
    step: TreeVerifyStep,
    bad_words: dict[int, list[list[int]]],  # request -> token ids of each bad word
    output_token_ids: list[list[int]],  # per request, the tokens generated so far
) -> None:
    """Ban, at each node, the last token of every bad word whose other tokens end the
    node's history: the request's output so far followed by the node's ancestors (as
    vLLM's sampler does with the output alone, and its chain sampler with the drafts
    before each row)."""
    flat_rows = rows.tolist()
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for r, node_paths in _node_paths(step, rows, bad_words).items():
        keep = max(len(word) for word in bad_words[r]) - 1  # the longest prefix
        tail = output_token_ids[r][max(0, len(output_token_ids[r]) - keep):] if keep else []
        for i, path in enumerate(node_paths):
            history = (tail + path)[max(0, len(tail) + len(path) - keep):] if keep else []
            for word in bad_words[r]:
                prefix = word[:-1]
                if len(prefix) <= len(history) and history[len(history) - len(prefix):] == prefix:
                    banned_rows.append(flat_rows[r][i])
                    banned_tokens.append(word[-1])
    if banned_rows:
        index = torch.tensor(banned_rows, dtype=torch.int64)
        token = torch.tensor(banned_tokens, dtype=torch.int64)
        logits[index.to(logits.device), token.to(logits.device)] = float("-inf")


def _apply_tree_min_tokens(
    logits: torch.Tensor,  # [num_rows, vocab] float32, edited in place
    rows: torch.Tensor,  # [num_reqs, width]
    step: TreeVerifyStep,
    proc: builtin_procs.MinTokensLogitsProcessor,
) -> None:
    """Stop tokens banned at each node whose token would come before the request's
    ``min_tokens``-th: a node at depth d proposes output token ``len(output) + d``.
    (The processor's own ``apply`` bans them at every node while the output is short,
    which would also ban them where plain decoding allows them.) As in vLLM, a
    structured-output request keeps its stop tokens where banning them would leave
    no token at all."""
    num_reqs = rows.shape[0]
    entries = [(r, e) for r, e in proc.min_toks.items() if r < num_reqs and e[2]]
    if not entries:
        return
    depths = step.tree.depths[:, : rows.shape[1]].tolist()
    num_scheduled = step.num_scheduled.tolist()
    flat_rows = rows.tolist()
    for r, (min_tokens, output_ids, stop_ids, grammar) in entries:
        remaining = min_tokens - len(output_ids)
        banned = [flat_rows[r][i] for i in range(num_scheduled[r] + 1) if depths[r][i] < remaining]
        if not banned:
            continue
        index = torch.tensor(banned, dtype=torch.int64, device=logits.device)[:, None]
        stop = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=logits.device)[None]
        kept = logits[index, stop]
        logits[index, stop] = float("-inf")
        if grammar:  # nothing else allowed: the stop tokens stay
            empty = torch.isneginf(logits[index[:, 0]]).all(dim=-1, keepdim=True)
            logits[index, stop] = torch.where(empty, kept, logits[index, stop])


def _apply_tree_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    req_of_row: torch.Tensor,
    step: TreeVerifyStep,
    sampling_metadata: SamplingMetadata,
) -> torch.Tensor:
    """Penalties at each node count that node's ancestors as generated."""
    num_reqs = rows.shape[0]
    histories: list[list[int]] = [[] for _ in range(logits.shape[0])]
    flat_rows = rows.tolist()
    for r, node_paths in _node_paths(step, rows, range(num_reqs)).items():
        base = sampling_metadata.output_token_ids[r]
        for i, path in enumerate(node_paths):
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
