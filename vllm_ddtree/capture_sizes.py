"""CUDA-graph sizes for a DDTree engine: a graph for every verify step it can run.

A verify step is ``budget + 1`` rows per request, and vLLM replays a full CUDA graph
only for a batch whose size is a captured size and a whole multiple of that width.
vLLM's default list stops at 512 tokens, so at budget 16 a step of 31 or more
requests ran without graphs; at 32 requests that alone made a DDTree step about 1.7x
slower on the H200 (DESIGN notes, §7). For a DDTree engine whose user chose no sizes,
the plugin therefore captures, besides vLLM's own token grid up to 512:

- ``n * (budget + 1)`` for the request counts vLLM uses for decode (1, 2, 4, 8, ...,
  every 8 to 256, every 16 beyond) up to ``max_num_seqs``, that count included: each
  uniform verify step;
- ``n * block_size`` likewise: the drafter's pass over n requests;
- where the tree's size varies per step (``ddtree_adaptive``, or vLLM's
  ``num_speculative_tokens_per_batch_size``), ``n * (k + 1)`` for every size k;

bounded by ``max_num_batched_tokens``, :data:`MAX_CAPTURE_TOKENS` and
:data:`MAX_CAPTURE_REQUESTS`. The engine logs at start-up how many requests its graphs
cover (runner/common.py).

The request bound keeps start-up and graph memory in proportion at vLLM's default
``max_num_seqs`` (up to 1024): on an H100 a DDTree engine sized per step (widths 1, 3,
5, 9, 17 and the drafter's 8) captured 320 sizes for steps of up to 481 requests, 1,104
full graphs besides the drafter's 876, about 100 s of start-up and 5.7 GiB; with steps
of up to 256 requests the list has 164 sizes. Above 256 requests a step is thousands of
rows, where a graph's saving of launch time is small, and vLLM's own grid up to 512
tokens still covers steps without trees there.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.config import tree_sizes

# The largest graph a DDTree engine captures unasked: 256 requests at budget 16 fit,
# and a graph this size holds only activations of one step (vLLM shares one pool).
MAX_CAPTURE_TOKENS = 8192
# The most requests whose uniform steps the plugin adds graphs for.
MAX_CAPTURE_REQUESTS = 256
# vLLM's own grid for batches that are not uniform verify steps (prefill next to trees).
DEFAULT_GRID_MAX = 512


def token_grid(limit: int) -> list[int]:
    """vLLM's grid up to ``limit``: 1, 2, 4, every 8 to 256, every 16 beyond."""
    sizes = [n for n in (1, 2, 4) if n <= limit]
    sizes += list(range(8, min(limit + 1, 256), 8))
    return sizes + list(range(256, limit + 1, 16))


def request_counts(max_reqs: int) -> list[int]:
    """Batch sizes whose steps get a graph: vLLM's grid up to ``max_reqs``, and
    ``max_reqs`` itself."""
    return sorted(set(token_grid(max_reqs)) | {max_reqs})


def ddtree_capture_sizes(vllm_config: Any) -> list[int] | None:
    """The capture sizes of a DDTree engine, or None where vLLM's own choice stands: the
    engine is no DDTree engine, runs without graphs, or the user chose the sizes or
    their ceiling (``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``)."""
    ddtree = getattr(vllm_config.speculative_config, "ddtree", None)
    compilation = vllm_config.compilation_config
    if ddtree is None or (compilation.cudagraph_capture_sizes is not None
                          or compilation.max_cudagraph_capture_size is not None):
        return None
    model = vllm_config.model_config
    if model is None or model.enforce_eager:
        return None
    ceiling = min(vllm_config.scheduler_config.max_num_batched_tokens, MAX_CAPTURE_TOKENS)
    max_reqs = min(vllm_config.scheduler_config.max_num_seqs, MAX_CAPTURE_REQUESTS)
    sizes = set(token_grid(min(DEFAULT_GRID_MAX, ceiling)))
    # Every verify width a step may have (one per tree size where sizes vary per step).
    widths = {k + 1 for k in tree_sizes(vllm_config)} | {ddtree.drafter_width}
    for width in sorted(widths):
        # Up to the most requests whose step fits under the ceiling, that count included.
        sizes.update(n * width for n in request_counts(min(max_reqs, ceiling // width)))
    return sorted(sizes)
