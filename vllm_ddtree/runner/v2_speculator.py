"""DDTreeSpeculator: DFlash drafting on vLLM's V2 model runner, tree output.

The drafter pass is V2's own DFlash pass (``DFlashSpeculator``: bonus token plus
``block_size - 1`` mask tokens per request, context K/V from the target's hidden
states, a full CUDA graph per batch size); only its last step differs. Where
DFlash samples one token per mask slot, the per-depth log-probabilities feed
:func:`~vllm_ddtree.ops.tree.build_ddtree` inside the same pass (so inside the same
graph), and the ``budget`` tree nodes become the draft tokens the target
verifies next step.

Two widths, as everywhere in the plugin: the drafter runs at ``block_size``
(``num_speculative_steps`` here is ``block_size - 1``), the target verifies
``budget + 1`` rows per request (vLLM's ``num_speculative_tokens``), which is
also how many context rows per request the drafter's graph stores.

The trees of the last pass stay in persistent buffers, in that pass's batch
order, with ``tree_row_of_state`` mapping each request's state index to its
row; the runner (runner.v2.begin_verify_step) reads them at the next verify.
After a tree step the runner's walk graph has made that mapping already
(``map_batch``, for the batch the pass then drafts over: ``mapped_batch``), which
saves the pass two launches.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.config import DDTreeConfig, get_ddtree_config, trees_are_sized
from vllm_ddtree.ops.subtree import best_subtree, node_scores
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.runner.common import drafter_view
from vllm_ddtree.runner.step_graphs import StepGraphs
from vllm_ddtree.tensors import DDTree

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers

TREE_FIELDS = ("tokens", "parents", "depths", "valid", "ancestor_mask", "num_nodes")


class DDTreeSpeculator(DFlashSpeculator):
    """V2 DFlash drafting at the drafter's block size, trees at the budget."""

    _speculator_name = "DDTree"

    def __init__(self, vllm_config, device: torch.device, req_states=None):
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is None:
            raise ValueError("DDTreeSpeculator needs a DDTree speculative config.")
        # Read by _num_graph_context_tokens during DFlashSpeculator.__init__.
        self.ddtree: DDTreeConfig = ddtree
        super().__init__(drafter_view(vllm_config, ddtree.max_depth), device)
        self.req_states = req_states
        rows, width = self.max_num_reqs, ddtree.verify_width
        # The last pass's trees, in its batch order ([rows, budget + 1] per field).
        self.trees = DDTree.zeros(rows, width, device)
        # Request state index -> its row in `trees` (-1: no tree from the last pass).
        self.tree_row_of_state = torch.full((rows,), -1, dtype=torch.int64, device=device)
        # Trees sized per step (vLLM's num_speculative_tokens_per_batch_size, or
        # ddtree_adaptive): each node's score, made by the pass (in its graph) for
        # best_subtree, which then ranks them between replays.
        self.sized = trees_are_sized(vllm_config)
        self.node_score = torch.zeros(rows, width, dtype=torch.float32, device=device)
        # The cut to k nodes, replayed as a CUDA graph per (batch, k) where the engine
        # uses graphs (runner/v2.py install enables them; eager until then).
        self.sizing_graphs = StepGraphs(device, "tree sizing", enabled=False)
        # A step of size 0 drafts nothing but stores the drafter's context: vLLM runs
        # that eagerly; it replays as a graph per batch shape (enabled by install too).
        self.context_graphs = StepGraphs(device, "drafter context", enabled=False)
        self._deferred: list[tuple[str, tuple]] | None = None
        self._batch_rows = torch.arange(rows, dtype=torch.int64, device=device)
        # The batch whose order tree_row_of_state holds already (runner/v2_sampler.py sets it
        # after its walk graph ran map_batch over that batch); cleared by propose.
        self.mapped_batch: Any = None
        # Query row of each request's bonus token in the drafter's batch.
        self._root_rows = self._batch_rows * self.num_query_per_req
        logger.info("DDTree drafting on the V2 model runner: drafter width %d, "
                    "verify width %d.", ddtree.drafter_width, ddtree.verify_width)

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        # Context rows per request: one verify step's, budget + 1 (not block_size).
        return min(num_reqs * self.ddtree.verify_width, self.max_num_tokens)

    def draft_logprobs(self, hidden_states: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """``[num_reqs, max_depth, vocab]`` float32: row d is log q_{d+1}. Runs inside
        the drafter's CUDA graph: no host synchronisation."""
        logits = self.model.compute_logits(hidden_states)[:, : self.ddtree.vocab_size]
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        return logprobs.view(num_reqs, self.ddtree.max_depth, -1)

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        last_hidden_states = self._run_model(
            num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
            cudagraph_runtime_mode,
        )
        num_sample = num_reqs * self.num_speculative_steps
        sample_hidden_states = last_hidden_states[self.sample_indices[:num_sample]]
        logprobs = self.draft_logprobs(sample_hidden_states, num_reqs)
        roots = self.input_buffers.input_ids[self._root_rows[:num_reqs]].to(torch.int64)
        tree = build_ddtree(logprobs, roots, self.ddtree.budget, self.ddtree.topk_cap)
        for field in TREE_FIELDS:
            getattr(self.trees, field)[:num_reqs].copy_(getattr(tree, field))
        if self.sized:
            self.node_score[:num_reqs].copy_(node_scores(tree, logprobs))

    def size_trees(self, num_reqs: int, k: int) -> None:
        """Cut the last pass's ``num_reqs`` trees to their best ``k`` nodes, in place
        (k < budget: the scheduler's size for this batch), between the drafter's
        replay and the next step: about fifty launches, which replay as one graph
        per (batch, k). They read and write only this speculator's buffers."""
        def launch() -> None:
            trees = DDTree(**{field: getattr(self.trees, field)[:num_reqs]
                              for field in TREE_FIELDS})
            sub = best_subtree(trees, self.node_score[:num_reqs], k, self.ddtree.max_depth)
            for field in TREE_FIELDS:
                getattr(trees, field).copy_(getattr(sub, field))

        self.sizing_graphs.run((num_reqs, k), (), launch)

    # A step of size 0: vLLM's pass stores the target's hidden states and the drafter's
    # context K/V for them, and stops (DFlashSpeculator.propose with no drafts). Both
    # calls are held while it runs and then made here, as one graph per shape.
    def _store_hidden_states(self, *args: Any, **kwargs: Any) -> None:
        if self._deferred is not None and not kwargs:
            self._deferred.append(("store", args))
            return
        super()._store_hidden_states(*args, **kwargs)

    def _precompute_context_kv(self, *args: Any, **kwargs: Any) -> None:
        if self._deferred is not None and not kwargs:
            self._deferred.append(("kv", args))
            return
        super()._precompute_context_kv(*args, **kwargs)

    def store_context(self, deferred: list[tuple[str, tuple]], num_reqs: int) -> None:
        """The calls a pass without drafts held back: ``store(n, last, aux)`` and then
        ``kv(0, n)``, replayed as a graph keyed by ``n`` over the target's output
        tensors (their addresses and shapes) where the pass was a decode step of
        ``num_reqs`` requests without drafts, one token each (n == num_reqs), so at most
        one graph per batch size. A step with a prefill or a verified tree in it (n is
        its token count, any number up to the step's token budget) and any other
        sequence run as they came: graphs keyed by those counts would be captured
        while serving, one per new count."""
        store = DFlashSpeculator._store_hidden_states
        kv = DFlashSpeculator._precompute_context_kv
        (first, store_args), *rest = deferred
        num_tokens = store_args[0]
        steady = (first == "store" and len(store_args) == 3 and len(rest) == 1
                  and num_tokens == num_reqs
                  and rest[0][0] == "kv" and rest[0][1] in ((0, num_tokens),
                                                             (0, num_tokens, False)))
        if not steady:
            for name, args in deferred:
                (store if name == "store" else kv)(self, *args)
            return
        _, last_hidden_states, aux_hidden_states = store_args
        outputs = [last_hidden_states, *(aux_hidden_states or ())]

        def launch() -> None:
            store(self, num_tokens, last_hidden_states, aux_hidden_states)
            kv(self, 0, num_tokens)

        self.context_graphs.run((num_tokens, len(outputs)), outputs, launch)

    def map_batch(self, idx_mapping: torch.Tensor) -> None:
        """``tree_row_of_state`` for a pass over a batch of these state indices
        (``[num_reqs]`` int64, batch order): state ``idx_mapping[i]`` -> row i, every
        other state -> -1 (no tree). No host sync: a CUDA graph may hold it."""
        self.tree_row_of_state.fill_(-1)
        self.tree_row_of_state.index_copy_(0, idx_mapping,
                                           self._batch_rows[: idx_mapping.shape[0]])

    def propose(self, input_batch, *args: Any, **kwargs: Any) -> torch.Tensor:
        """DFlash's pass; returns the trees' ``[num_reqs, budget]`` draft tokens in node
        order (preorder: parents before children), a view of ``trees.tokens``."""
        dummy = kwargs.get("dummy_run", False)
        k = kwargs.get("num_speculative_tokens")
        built = k != 0
        mapped, self.mapped_batch = self.mapped_batch, None
        if k == 0 and not dummy and self.context_graphs.enabled:
            self._deferred = []
        try:
            super().propose(input_batch, *args, **kwargs)
        finally:
            deferred, self._deferred = self._deferred, None
        if deferred:
            self.store_context(deferred, input_batch.num_reqs)
        num_reqs = input_batch.num_reqs
        dp_sync_state = kwargs.get("dp_sync_state")
        if dummy and dp_sync_state is not None:
            num_reqs = min(num_reqs, dp_sync_state.num_reqs)
        if built and not dummy and num_reqs > 0:
            if mapped is not input_batch:
                self.map_batch(input_batch.idx_mapping[:num_reqs])
            if k is not None and k < self.ddtree.budget:
                if not self.sized:
                    raise RuntimeError(f"DDTree: {k} drafts asked of a speculator "
                                       "whose trees are not sized per step")
                self.size_trees(num_reqs, k)
        else:
            self.tree_row_of_state.fill_(-1)
        return self.trees.tokens[:num_reqs, 1:]
