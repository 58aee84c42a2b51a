"""The tensors a DDTree step passes between its parts, with their shapes and checks.

Every op (``ops/``), kernel (``kernels/``) and runner (``runner/``) speaks in these
types: a batch of trees (:class:`DDTree`), the walk's result (:class:`WalkResult`), one
verify step (:class:`TreeVerifyStep`), the compaction's moves (:class:`CompactionPlan`,
:class:`SlotMoves`) and the packed ancestor-mask format the attention kernels read.
This module imports nothing of the plugin, so kernels and their torch twins can both
depend on it without a cycle.

Packed mask. Column ``j`` of a mask row is bit ``j % 32`` (least significant bit
first) of int32 word ``j // 32``; bit 31 is the sign bit, so a word may be negative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DDTree:
    tokens: torch.Tensor  # [num_reqs, budget + 1] int64; column 0 = root (bonus token)
    parents: torch.Tensor  # [num_reqs, budget + 1] int64; parents[:, 0] = 0; parents[:, i] < i
    depths: torch.Tensor  # [num_reqs, budget + 1] int64; root 0, valid node >= 1, padding 0
    valid: torch.Tensor  # [num_reqs, budget + 1] bool; root True, padding False
    ancestor_mask: torch.Tensor  # [num_reqs, budget + 1, budget + 1] bool; [r, i, j]: j ancestor-or-self of i
    num_nodes: torch.Tensor  # [num_reqs] int64; valid nodes besides the root (<= budget)

    @property
    def budget(self) -> int:
        return self.tokens.shape[1] - 1

    @classmethod
    def zeros(cls, num_reqs: int, width: int, device: torch.device) -> DDTree:
        """Persistent tree buffers of ``num_reqs`` rows of ``width`` nodes, zeroed."""
        i64 = {"dtype": torch.int64, "device": device}
        return cls(
            tokens=torch.zeros(num_reqs, width, **i64),
            parents=torch.zeros(num_reqs, width, **i64),
            depths=torch.zeros(num_reqs, width, **i64),
            valid=torch.zeros(num_reqs, width, dtype=torch.bool, device=device),
            ancestor_mask=torch.zeros(num_reqs, width, width, dtype=torch.bool, device=device),
            num_nodes=torch.zeros(num_reqs, **i64),
        )


@dataclass
class WalkResult:
    accepted_nodes: torch.Tensor  # [num_reqs, max_depth + 1] int64; node at each depth, col 0 = 0, -1 past num_accepted
    num_accepted: torch.Tensor  # [num_reqs] int64; accepted drafts (bonus excluded), 0..min(budget, max_depth)
    bonus_tokens: torch.Tensor  # [num_reqs] int64; target token at the last accepted node
    output_tokens: torch.Tensor  # [num_reqs, budget + 1] int64; chain format: accepted, bonus, -1 ...


def walk_buffers(num_reqs: int, n: int, max_depth: int, device: torch.device,
                 out: WalkResult | None = None) -> WalkResult:
    """Where a walk of ``num_reqs`` trees of ``n`` nodes is written: the leading rows
    of ``out`` (checked), or new tensors."""
    if out is None:
        return WalkResult(
            accepted_nodes=torch.empty(num_reqs, max_depth + 1, dtype=torch.int64,
                                       device=device),
            num_accepted=torch.empty(num_reqs, dtype=torch.int64, device=device),
            bonus_tokens=torch.empty(num_reqs, dtype=torch.int64, device=device),
            output_tokens=torch.empty(num_reqs, n, dtype=torch.int64, device=device),
        )
    fits = (
        out.accepted_nodes.shape[0] >= num_reqs and out.accepted_nodes.shape[1] == max_depth + 1
        and out.output_tokens.shape[0] >= num_reqs and out.output_tokens.shape[1] >= n
        and out.num_accepted.shape[0] >= num_reqs and out.bonus_tokens.shape[0] >= num_reqs
        and out.accepted_nodes.is_contiguous() and out.output_tokens.is_contiguous()
        and all(t.dtype == torch.int64 for t in (out.accepted_nodes, out.num_accepted,
                                                   out.bonus_tokens, out.output_tokens))
    )
    if not fits:
        raise ValueError(
            f"out must hold int64 walks of >= {num_reqs} requests, max depth {max_depth} "
            f"and >= {n} nodes, got accepted_nodes {tuple(out.accepted_nodes.shape)} and "
            f"output_tokens {tuple(out.output_tokens.shape)}"
        )
    return WalkResult(
        accepted_nodes=out.accepted_nodes[:num_reqs],
        num_accepted=out.num_accepted[:num_reqs],
        bonus_tokens=out.bonus_tokens[:num_reqs],
        # Rows of n, row-major, whatever the buffer's width: the kernel's layout.
        output_tokens=out.output_tokens.view(-1)[: num_reqs * n].view(num_reqs, n),
    )


def check_counts_args(
    num_reqs: int,
    num_sampled_out: torch.Tensor | None,
    num_rejected_out: torch.Tensor | None,
    chunked_prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """The count outputs of walk_rows and its Triton twin: int32 [num_reqs]; the
    rejected count and the prefill rule come with the committed count."""
    for name, t in (("num_sampled_out", num_sampled_out), ("num_rejected_out", num_rejected_out)):
        if t is not None and (t.shape != (num_reqs,) or t.dtype != torch.int32):
            raise ValueError(f"{name} must be int32 [{num_reqs}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    if num_sampled_out is None and (num_rejected_out is not None or chunked_prefill is not None):
        raise ValueError("num_rejected_out and chunked_prefill come with num_sampled_out")
    if chunked_prefill is not None and (
        len(chunked_prefill) != 3 or chunked_prefill[0].shape[0] < num_reqs
        or chunked_prefill[1].shape[0] < num_reqs
    ):
        raise ValueError("chunked_prefill is (seq_lens, idx_mapping, prefill_len), the "
                         f"first two over >= {num_reqs} requests")


def check_walk_args(tree: DDTree, target_tokens: torch.Tensor, max_depth: int) -> None:
    """Shapes and depth shared by walk_tree and its Triton twin."""
    num_reqs, n = tree.tokens.shape
    if target_tokens.shape != (num_reqs, n):
        raise ValueError(
            f"target_tokens must be [num_reqs, budget + 1] = {(num_reqs, n)}, "
            f"got {tuple(target_tokens.shape)}"
        )
    check_max_depth(max_depth)


def check_max_depth(max_depth: int) -> None:
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")


@dataclass
class TreeVerifyStep:
    """The trees verified in one target step, aligned with the batch rows."""

    tree: DDTree  # [num_reqs, budget + 1] per field; nodes past num_scheduled invalid
    num_scheduled: torch.Tensor  # [num_reqs] int64, tree nodes sent to the target
    row_start: torch.Tensor  # [num_reqs] int64, flat token row of each root
    max_depth: int  # drafter block_size - 1
    walk: WalkResult | None = None  # filled in by the sampler


@dataclass
class CompactionPlan:
    src_rows: torch.Tensor  # [num_reqs, max_depth + 1] int64; query_start + node_d on the path, query_start (identity) past it
    dst_rows: torch.Tensor  # [num_reqs, max_depth + 1] int64; query_start + d on the path, query_start past it
    hidden_rows: torch.Tensor  # [num_reqs, max_depth + 1] int64; = src_rows: hidden states in path order


@dataclass
class SlotMoves:
    """One step's KV moves as (block, offset) pairs: computed once per slot mapping and
    page size, then used by every layer of the cache group (no per-layer index math)."""

    src_block: torch.Tensor  # [num_moves] int64
    src_offset: torch.Tensor  # [num_moves] int64
    dst_block: torch.Tensor  # [num_moves] int64
    dst_offset: torch.Tensor  # [num_moves] int64


def tree_outputs(num_reqs: int, width: int, device: torch.device, out: DDTree | None
                 ) -> tuple[torch.Tensor, ...]:
    """The step's tree fields: new tensors, or row-major views at the start of
    ``out``'s (contiguous, wide and long enough, of the fields' dtypes)."""
    shapes = ((width,),) * 4 + ((width, width), ())
    dtypes = (torch.int64,) * 3 + (torch.bool, torch.bool, torch.int64)
    if out is None:
        return tuple(torch.empty(num_reqs, *shape, dtype=dtype, device=device)
                     for shape, dtype in zip(shapes, dtypes))
    fields = (out.tokens, out.parents, out.depths, out.valid, out.ancestor_mask, out.num_nodes)
    views = []
    for field, shape, dtype in zip(fields, shapes, dtypes):
        size = num_reqs * max(1, width ** len(shape))
        if field.dtype != dtype or not field.is_contiguous() or field.numel() < size or (
            shape and field.shape[1] < width
        ):
            raise ValueError(
                f"out's fields must be contiguous, {dtypes} and hold {num_reqs} requests "
                f"of width {width}; got {field.dtype} {tuple(field.shape)}"
            )
        views.append(field.view(-1)[:size].view(num_reqs, *shape))
    return tuple(views)


BITS_PER_WORD = 32


def pack_tree_mask(
    tree_mask: torch.Tensor,  # [num_reqs, max_q, num_cols] bool
) -> torch.Tensor:  # [num_reqs, max_q, ceil(num_cols / 32)] int32
    """Pack mask columns into int32 words: column ``j`` is bit ``j % 32`` of word
    ``j // 32``.

    Bit 0 is the least significant bit. Bit 31 is the two's-complement sign bit, so a
    word whose column ``32 * w + 31`` is set is negative. Bits past ``num_cols`` are 0.
    """
    if tree_mask.dtype != torch.bool or tree_mask.dim() != 3:
        raise ValueError(
            f"tree_mask must be a 3-D bool tensor, got {tree_mask.dtype} "
            f"of shape {tuple(tree_mask.shape)}"
        )
    num_reqs, max_q, num_cols = tree_mask.shape
    num_words = -(-num_cols // BITS_PER_WORD)
    bits = tree_mask.new_zeros(num_reqs, max_q, num_words * BITS_PER_WORD)
    bits[..., :num_cols] = tree_mask
    bits = bits.view(num_reqs, max_q, num_words, BITS_PER_WORD).to(torch.int64)
    weights = 1 << torch.arange(BITS_PER_WORD, dtype=torch.int64, device=bits.device)
    words = (bits * weights).sum(dim=-1)  # [num_reqs, max_q, num_words], in [0, 2**32)
    # Reinterpret as two's complement so the int32 cast keeps all 32 bits.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_tree_mask(
    packed: torch.Tensor,  # [num_reqs, max_q, num_words] int32
    num_cols: int | None = None,
) -> torch.Tensor:  # [num_reqs, max_q, num_cols] bool
    """Inverse of ``pack_tree_mask``; ``num_cols`` defaults to ``max_q`` (square)."""
    if packed.dtype != torch.int32 or packed.dim() != 3:
        raise ValueError(
            f"packed mask must be a 3-D int32 tensor, got {packed.dtype} "
            f"of shape {tuple(packed.shape)}"
        )
    num_cols = packed.shape[1] if num_cols is None else num_cols
    if not 0 <= num_cols <= packed.shape[2] * BITS_PER_WORD:
        raise ValueError(
            f"num_cols={num_cols} does not fit in {packed.shape[2]} words of "
            f"{BITS_PER_WORD} bits"
        )
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=packed.device)
    # Arithmetic right shift keeps the low bits exact, also for negative words.
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [num_reqs, max_q, num_words, 32]
    return bits.flatten(-2)[..., :num_cols].bool()


def mask_buffer(max_num_reqs: int, width: int, device: torch.device) -> torch.Tensor:
    """The persistent ``[max_num_reqs, width, ceil(width / 32)]`` int32 buffer that
    packed masks are written into: a captured tree kernel reads its masks from here."""
    words = -(-width // BITS_PER_WORD)
    return torch.zeros(max_num_reqs, width, words, dtype=torch.int32, device=device)


def packed_view(buffer: torch.Tensor, num_reqs: int, width: int) -> torch.Tensor:
    """The ``[num_reqs, width, ceil(width / 32)]`` corner of a mask buffer that holds
    a step's packed masks (pack_tree_mask's layout)."""
    return buffer[:num_reqs, :width, : -(-width // BITS_PER_WORD)]
