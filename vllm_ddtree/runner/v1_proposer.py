"""DDTreeProposer: one DFlash drafter pass per step, then the optimal tree.

The drafter runs exactly as vLLM's native DFlash (bonus token + block_size - 1
mask tokens per request, context from the target's hidden states); only the
last step differs: instead of taking the argmax of every mask slot as a chain,
the per-depth log-probabilities feed :func:`~vllm_ddtree.ops.tree.build_ddtree`,
and the ``budget`` tree nodes become the draft tokens the target verifies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.ops.subtree import best_subtree, node_scores
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.runner.common import drafter_view
from vllm_ddtree.runner.tree_graph import TreeBuildGraphs
from vllm_ddtree.sync import step_phase
from vllm_ddtree.tensors import DDTree

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handlers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.sample.metadata import SamplingMetadata


class DDTreeProposer(DFlashProposer):
    """DFlash drafting at the drafter's block size, tree output at the budget."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is None:
            raise ValueError("DDTreeProposer needs a DDTree speculative config.")
        self.ddtree: DDTreeConfig = ddtree
        # The drafter's buffers are sized by its own width, block_size, while
        # vLLM's num_speculative_tokens is the verify budget.
        super().__init__(drafter_view(vllm_config, ddtree.max_depth), device, runner)
        self.runner = runner
        self.last_tree: DDTree | None = None
        self._draft_logprobs: torch.Tensor | None = None
        # On CUDA (unless the engine runs eagerly) the tree build replays a CUDA graph.
        self.tree_graphs: TreeBuildGraphs | None = None
        if torch.device(device).type == "cuda" and not vllm_config.model_config.enforce_eager:
            self.tree_graphs = TreeBuildGraphs(
                ddtree.budget, ddtree.topk_cap, ddtree.max_depth, ddtree.vocab_size,
                vllm_config.scheduler_config.max_num_seqs, torch.device(device),
            )
            logger.info("DDTree tree build: one CUDA graph per batch of 1 to %d requests "
                        "(captured at first use), eager above.", self.tree_graphs.max_reqs)

    def propose(self, num_speculative_tokens: int, *args: Any, **kwargs: Any):
        if num_speculative_tokens == 0:
            self.last_tree = None
            return super().propose(0, *args, **kwargs)
        next_token_ids = kwargs["next_token_ids"]
        super().propose(self.ddtree.max_depth, *args, **kwargs)
        logprobs = self._draft_logprobs
        assert logprobs is not None, "the DFlash pass produced no logits"
        self._draft_logprobs = None
        num_reqs = next_token_ids.shape[0]
        # [num_reqs, max_depth, vocab]: row d is log q_{d+1}.
        logprobs = logprobs.view(num_reqs, self.ddtree.max_depth, -1)
        with step_phase("ddtree.build_tree", logprobs.device):
            if self.tree_graphs is not None and self.tree_graphs.holds(logprobs):
                tree = self.tree_graphs.build(num_reqs, next_token_ids)
            else:
                tree = build_ddtree(
                    logprobs, next_token_ids, self.ddtree.budget, self.ddtree.topk_cap
                )
            if num_speculative_tokens < self.ddtree.budget:
                # A smaller tree this step (the scheduler's size for the batch): the
                # best num_speculative_tokens nodes of the budget tree.
                tree = best_subtree(tree, node_scores(tree, logprobs),
                                    num_speculative_tokens, self.ddtree.max_depth)
        self.last_tree = tree
        # Draft tokens in node order: preorder, parents before children.
        return tree.tokens[:, 1 : num_speculative_tokens + 1]

    def _sample_draft_tokens(
        self,
        hidden_states: torch.Tensor,  # [num_reqs * max_depth, hidden]
        sampling_metadata: SamplingMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.model.compute_logits(hidden_states)
        vocab = self.ddtree.vocab_size
        # Straight into the tree-build graph's input buffer where one serves this batch.
        num_reqs, rest = divmod(logits.shape[0], self.ddtree.max_depth)
        out = (self.tree_graphs.logprobs_out(num_reqs)
               if self.tree_graphs is not None and rest == 0 else None)
        self._draft_logprobs = torch.log_softmax(logits[:, :vocab], dim=-1,
                                                 dtype=torch.float32, out=out)
        # DFlash's own chain drafts (an argmax over every row) are never read: the
        # drafts are the tree's (propose). Right shape, nothing launched.
        return torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device), None


