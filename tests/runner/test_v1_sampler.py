"""Unit tests of the tree sampler's pieces (vllm_ddtree/runner/v1_sampler.py), on CPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.ops.step_trees import chain_trees, select_trees
from vllm_ddtree.ops.tree import build_ddtree
from vllm_ddtree.ops.walk import step_rows, walk_tree
from vllm_ddtree.runner import v1_sampler as sampler
from vllm_ddtree.runner.v1_sampler import inverse_cdf_sample, sample_node_tokens
from vllm_ddtree.tensors import TreeVerifyStep


@dataclass
class FakeSpecMetadata:
    """The fields of vLLM's SpecDecodeMetadata the sampler reads."""

    num_draft_tokens: list[int]
    draft_token_ids: torch.Tensor
    cu_num_draft_tokens: torch.Tensor = field(init=False)
    cu_num_sampled_tokens: torch.Tensor = field(init=False)

    def __post_init__(self):
        n = torch.tensor(self.num_draft_tokens)
        self.cu_num_draft_tokens = n.cumsum(0)
        self.cu_num_sampled_tokens = (n + 1).cumsum(0)
        self.max_spec_len = max(self.num_draft_tokens)


@dataclass
class FakeSampling:
    all_greedy: bool
    temperature: torch.Tensor
    all_random: bool = False
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    generators: dict = field(default_factory=dict)
    logitsprocs: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(non_argmax_invariant=[], argmax_invariant=[]))


def _metadata(drafts: list[list[int]]) -> FakeSpecMetadata:
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    return FakeSpecMetadata([len(d) for d in drafts], flat)


def test_chain_trees_structure():
    meta = _metadata([[5, 6, 7], [], [9]])
    n = torch.tensor(meta.num_draft_tokens)
    tree = chain_trees(meta, n, width=4)
    assert tree.tokens.tolist() == [[0, 5, 6, 7], [0, 0, 0, 0], [0, 9, 0, 0]]
    assert tree.valid.tolist() == [[True] * 4, [True, False, False, False],
                                  [True, True, False, False]]
    assert tree.depths[0].tolist() == [0, 1, 2, 3]
    assert tree.parents[0].tolist() == [0, 0, 1, 2]
    # Every row attends to itself; chains are lower-triangular on real nodes.
    assert tree.ancestor_mask.diagonal(dim1=1, dim2=2).all()
    assert tree.ancestor_mask[0].tolist() == torch.tril(torch.ones(4, 4)).bool().tolist()
    # A chain walk with the drafts as target tokens accepts them all.
    target = torch.tensor([[5, 6, 7, 8], [3, 0, 0, 0], [9, 4, 0, 0]])
    walk = walk_tree(tree, target, max_depth=3)
    assert walk.num_accepted.tolist() == [3, 0, 1]
    assert walk.output_tokens.tolist() == [[5, 6, 7, 8], [3, -1, -1, -1], [9, 4, -1, -1]]


def _drafted_trees(num_reqs: int, budget: int, depth: int = 3, vocab: int = 12):
    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(num_reqs, depth, vocab, generator=g).log_softmax(-1)
    return build_ddtree(logprobs, torch.arange(num_reqs), budget, topk_cap=3)


def test_select_trees_prefix_mismatch_and_padding():
    drafted = _drafted_trees(3, budget=6)
    nodes = drafted.tokens[:, 1:].tolist()
    # Request 0: all nodes; request 1: a 3-node prefix (still a tree);
    # request 2: drafts that differ from its tree -> verified as a chain.
    sent = [nodes[0], nodes[1][:3], [t + 1 for t in nodes[2]]]
    meta = _metadata(sent)
    n = torch.tensor(meta.num_draft_tokens)
    chains = chain_trees(meta, n, width=7)
    tree = select_trees(drafted, [0, 1, 2], chains, n)
    assert torch.equal(tree.parents[0], drafted.parents[0])
    assert torch.equal(tree.depths[1, :4], drafted.depths[1, :4])
    assert tree.valid[1].tolist() == [True] * 4 + [False] * 3
    assert torch.equal(tree.parents[2], chains.parents[2])
    assert torch.equal(tree.tokens[2], chains.tokens[2])
    assert tree.ancestor_mask.diagonal(dim1=1, dim2=2).all()
    # Unknown requests (-1) get their chain.
    tree = select_trees(drafted, [-1, 1, 2], chains, n)
    assert torch.equal(tree.parents[0], chains.parents[0])


def test_select_trees_keeps_padding_nodes_self_attending():
    # Top-1 per depth, depth 3: only 3 nodes fit a budget of 6 -> padding.
    g = torch.Generator().manual_seed(1)
    logprobs = torch.randn(1, 3, 8, generator=g).log_softmax(-1)
    drafted = build_ddtree(logprobs, torch.tensor([0]), 6, topk_cap=1)
    assert drafted.num_nodes.tolist() == [3]
    meta = _metadata([drafted.tokens[0, 1:].tolist()])
    n = torch.tensor(meta.num_draft_tokens)
    tree = select_trees(drafted, [0], chain_trees(meta, n, 7), n)
    assert tree.valid[0].tolist() == [True] * 4 + [False] * 3
    assert tree.ancestor_mask[0].diagonal().all()
    # Padding rows see only the root besides themselves.
    assert tree.ancestor_mask[0, 5].nonzero().flatten().tolist() == [0, 5]


def test_step_rows_clamp_absent_nodes():
    cu = torch.tensor([4, 5, 8])
    n = torch.tensor([3, 0, 2])
    rows = step_rows(cu, n, width=4)
    assert rows.tolist() == [[0, 1, 2, 3], [4, 4, 4, 4], [5, 6, 7, 7]]


def test_greedy_node_tokens_are_argmax():
    logits = torch.randn(7, 10)
    rows = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 6]])
    sampling = FakeSampling(all_greedy=True, temperature=torch.zeros(2))
    tokens = sample_node_tokens(logits, rows, sampling)
    assert torch.equal(tokens, logits.argmax(-1)[rows])


def test_seeded_sampling_is_reproducible_and_follows_top_k():
    # On the platform's device: on a CUDA host vLLM's top-k runs a Triton kernel.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(6, 50, device=device)
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]], device=device)

    def draw(seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        sampling = FakeSampling(all_greedy=False,
                                temperature=torch.tensor([0.0, 1.0], device=device),
                                top_k=torch.tensor([50, 2], device=device), generators={1: gen})
        return sample_node_tokens(logits, rows, sampling)

    a, b, c = draw(3), draw(3), draw(4)
    assert torch.equal(a, b)
    # Request 0 is greedy inside a random batch.
    assert torch.equal(a[0], logits.argmax(-1)[rows[0]])
    # Request 1 samples within its top-2 tokens.
    top2 = logits[rows[1]].topk(2, dim=-1).indices
    assert all(a[1, i] in top2[i] and c[1, i] in top2[i] for i in range(3))


def _seeded_trimmed_batch(device: str, seed: int):
    """A seeded request whose tree was trimmed (2 of 4 drafts scheduled: its last two
    node columns repeat its last row) next to an unseeded one: (logits, rows, sampling)."""
    torch.manual_seed(0)
    logits = torch.randn(8, 64, device=device)
    rows = step_rows(torch.tensor([3, 8], device=device), torch.tensor([2, 4], device=device), 5)
    gen = torch.Generator(device=device).manual_seed(seed)
    sampling = FakeSampling(all_greedy=False, all_random=True,
                            temperature=torch.tensor([1.0, 1.0], device=device),
                            generators={0: gen})
    return logits, rows, sampling


def first_above(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF oracle: how many prefix sums stay at or below u times the total."""
    cdf = probs.cumsum(0)
    return int((cdf <= u * cdf[-1]).sum())


def test_seeded_request_draws_one_uniform_per_node_column():
    """Node j of a seeded request takes the j-th of ``count`` uniforms from its
    generator and the inverse CDF of its probabilities; the columns past its nodes
    repeat its last node's token. The draw's size is the request's own (3 nodes here),
    not the batch's width (5), so its stream does not depend on the other requests."""
    logits, rows, sampling = _seeded_trimmed_batch("cpu", seed=5)
    tokens = sample_node_tokens(logits, rows, sampling, [3, 5])
    gen = torch.Generator().manual_seed(5)
    uniforms = torch.rand(3, generator=gen)
    probs = logits[:3].softmax(-1)
    want = [first_above(probs[min(j, 2)], float(uniforms[min(j, 2)])) for j in range(5)]
    assert tokens[0].tolist() == want
    assert torch.equal(gen.get_state(), sampling.generators[0].get_state())
    again = sample_node_tokens(*_seeded_trimmed_batch("cpu", seed=5), [3, 5])
    assert torch.equal(again, tokens)


def _plain_cpu_seeds(seed: int, count: int) -> list[int]:
    """The seeds vLLM's CPU sampler draws for a seeded request over ``count`` steps."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long).item()
            for _ in range(count)]


def test_node_seeds_follow_plain_decodings_steps():
    """A node at depth d gets the seed plain decoding draws d steps from now; after a
    walk that commits k tokens the generator stands where plain decoding leaves it
    after k steps, whatever the tree's depth."""
    rows = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 7, 7]])
    depths = torch.tensor([[0, 1, 2, 1, 3], [0, 1, 2, 0, 0]])
    plain = _plain_cpu_seeds(7, 6)
    for committed in (1, 2, 4):
        gen = torch.Generator().manual_seed(7)
        seeds = sampler.NodeSeeds.draw({0: gen}, rows, depths, [5, 3], num_rows=8)
        assert seeds.seeds[:5].tolist() == [plain[d] for d in (0, 1, 2, 1, 3)]
        seeds.rewind({0: gen}, [committed, 3])
        next_draw = torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long).item()
        assert next_draw == plain[committed]


def test_seeded_nodes_draw_as_vllms_cpu_sampler():
    """With seeds, a node's token is vLLM's CPU draw (gumbel-max keyed by the seed)
    from its processed, tempered, top-k-filtered logits: what plain decoding samples
    at that position from the same logits and seed."""
    if not hasattr(torch.ops._C, "fused_gumbel_argmax"):
        pytest.skip("vLLM's CPU sampling kernel is not loaded")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]])
    seeds = torch.tensor([11, 12, 13, 14, 15, 16])
    sampling = FakeSampling(all_greedy=False, all_random=True,
                            temperature=torch.tensor([0.7, 1.3]),
                            top_k=torch.tensor([5, 50]))
    tokens = sample_node_tokens(logits, rows, sampling, [3, 3], seeds)
    temps = torch.tensor([0.7] * 3 + [1.3] * 3)[:, None]
    filtered = apply_top_k_top_p(logits / temps, torch.tensor([5] * 3 + [50] * 3), None)
    want = torch.ops._C.fused_gumbel_argmax(filtered.contiguous(), seeds)
    assert torch.equal(tokens.flatten(), want)


def test_inverse_cdf_sample_follows_the_distribution_and_skips_zeros():
    """Many rows of one distribution (two tokens masked to zero, one tiny): the
    frequencies match it within five standard errors, and no zero-probability token
    is drawn, not even at u = 0 or u just below 1."""
    probs = torch.tensor([0.0, 0.3, 0.0, 0.1, 1e-6, 0.25, 0.35, 0.0])
    n = 200_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(0))
    uniforms[:2] = torch.tensor([0.0, 1.0 - 2.0**-24])
    tokens = inverse_cdf_sample(probs.expand(n, -1).contiguous(), uniforms)
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[probs == 0].sum() == 0
    expected = probs.double() / probs.sum() * n
    stderr = (expected * (1 - probs.double() / probs.sum())).sqrt()
    assert ((counts - expected).abs() <= 5 * stderr + 1).all(), (counts, expected)
    assert tokens[0] == 1 and tokens[1] == 6  # the first and last tokens that can be drawn


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_on_cuda_never_waits_for_the_device():
    """Seeded requests (trimmed trees included) sample without a host-device sync, and
    the seeded one reproducibly, repeated rows and all."""
    batches = [_seeded_trimmed_batch("cuda", seed=5) for _ in range(2)]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a, b = (sample_node_tokens(*batch, [3, 5]) for batch in batches)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(a[0], b[0])  # request 1 draws from the global generator


def test_all_random_batch_skips_the_greedy_argmax(monkeypatch):
    """No request of the batch is greedy: the tokens are the same draws, without the
    argmax pass over every node's vocabulary that only greedy requests use."""
    logits = torch.randn(6, 50)
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]])

    def draw(all_random: bool) -> torch.Tensor:
        torch.manual_seed(9)
        sampling = FakeSampling(all_greedy=False, all_random=all_random,
                                temperature=torch.tensor([0.7, 1.0]))
        return sample_node_tokens(logits, rows, sampling)

    want = draw(False)
    argmaxes: list = []
    original = torch.Tensor.argmax

    def counting_argmax(self, *args, **kwargs):
        argmaxes.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "argmax", counting_argmax)
    assert torch.equal(draw(True), want)
    assert argmaxes == []  # the inverse CDF takes no argmax


def test_tree_verify_step_is_a_plain_record():
    drafted = _drafted_trees(1, budget=2)
    step = TreeVerifyStep(tree=drafted, num_scheduled=torch.tensor([2]),
                          row_start=torch.tensor([0]), max_depth=3)
    assert step.walk is None


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_walk_on_selected_tree_matches_python_walk(budget):
    drafted = _drafted_trees(2, budget=budget)
    meta = _metadata(drafted.tokens[:, 1:].tolist())
    n = torch.tensor(meta.num_draft_tokens)
    tree = select_trees(drafted, [0, 1], chain_trees(meta, n, budget + 1), n)
    # Target follows the first child everywhere: the walk goes to the leaf.
    target = torch.zeros_like(tree.tokens)
    for r in range(2):
        for i in range(budget + 1):
            kids = [j for j in range(1, budget + 1)
                    if tree.valid[r, j] and tree.parents[r, j] == i]
            target[r, i] = tree.tokens[r, kids[0]] if kids else 999
    walk = walk_tree(tree, target, max_depth=3)
    for r in range(2):
        node, depth = 0, 0
        while True:
            kids = [j for j in range(1, budget + 1)
                    if tree.valid[r, j] and tree.parents[r, j] == node]
            if not kids:
                break
            node, depth = kids[0], depth + 1
        assert walk.num_accepted[r] == depth


class RecordingProcessor:
    """A custom logits processor: adds 1 to every logit and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return logits + 1


def _builtin(cls, state_name: str, state) -> object:
    proc = object.__new__(cls)  # no engine config needed for the idle check
    setattr(proc, state_name, state)
    proc.apply = lambda logits: logits - 100  # would show if an idle one ran
    return proc


def test_idle_builtin_processors_are_skipped_and_others_run():
    """Built-ins no request uses are skipped (a greedy batch then pays no per-column
    loop); a used built-in and every custom processor run once per tree column."""
    from vllm.v1.sample.logits_processor import builtin

    idle = [_builtin(builtin.MinPLogitsProcessor, "min_p_count", 0),
            _builtin(builtin.LogitBiasLogitsProcessor, "biases", {}),
            _builtin(builtin.MinTokensLogitsProcessor, "min_toks", {})]
    used = _builtin(builtin.LogitBiasLogitsProcessor, "biases", {0: {3: 2.0}})
    custom = RecordingProcessor()
    assert all(sampler._idle(p) for p in idle)
    assert not sampler._idle(used) and not sampler._idle(custom)

    rows = torch.tensor([[0, 1, 2], [3, 4, 4]])  # request 1 sent one draft
    step = SimpleNamespace(num_scheduled=torch.tensor([2, 1]))
    logits = torch.zeros(5, 7)
    metadata = SimpleNamespace(
        allowed_token_ids_mask=None, no_penalties=True, all_greedy=True, max_num_logprobs=None,
        bad_words_token_ids={},
        logitsprocs=SimpleNamespace(non_argmax_invariant=[*idle, custom], argmax_invariant=[]))
    out = sampler.process_logits(logits, rows, step, metadata)
    assert custom.calls == 3  # one [num_reqs, vocab] block per column
    assert torch.equal(out, torch.ones(5, 7))  # every row once; idle built-ins never ran
    metadata.logitsprocs.non_argmax_invariant = idle
    assert sampler.process_logits(logits, rows, step, metadata) is logits  # nothing to do
    metadata.logitsprocs.non_argmax_invariant = [used]
    assert torch.equal(sampler.process_logits(logits, rows, step, metadata), logits - 100)
    assert torch.equal(logits, torch.zeros(5, 7))  # processed on a copy


def test_the_walk_refuses_trees_of_another_width():
    """Every verified draft needs its node: trees narrower than the step are an error,
    not a silently shorter walk."""
    drafted = _drafted_trees(1, budget=3)
    step = sampler.TreeVerifyStep(tree=drafted, num_scheduled=torch.tensor([3]),
                                  row_start=torch.tensor([0]), max_depth=3)
    meta = _metadata([[5, 6, 7, 8]])  # four drafts: width 5
    module = sampler.DDTreeSampler(SimpleNamespace(), lambda: step)
    with pytest.raises(RuntimeError, match="4 nodes per request, but 4 drafts"):
        module(meta, None, torch.zeros(5, 10), SimpleNamespace())


def test_greedy_batch_with_nothing_to_apply_keeps_its_raw_logits():
    """No float32 copy of a bf16 [num_rows, vocab] block when only argmaxes are taken,
    and the same node tokens as from the float32 logits (ties included)."""
    rows = torch.tensor([[0, 1, 2], [3, 4, 4]])
    step = SimpleNamespace(num_scheduled=torch.tensor([2, 1]))
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randint(0, 4, (5, 9), generator=gen).float() / 4).to(torch.bfloat16)
    metadata = SimpleNamespace(
        allowed_token_ids_mask=None, no_penalties=True, all_greedy=True, max_num_logprobs=None,
        bad_words_token_ids={},
        logitsprocs=SimpleNamespace(non_argmax_invariant=[], argmax_invariant=[]))
    out = sampler.process_logits(logits, rows, step, metadata)
    assert out is logits
    sampling = FakeSampling(all_greedy=True, temperature=torch.zeros(2))
    assert torch.equal(sample_node_tokens(out, rows, sampling),
                       sample_node_tokens(logits.float(), rows, sampling))
    metadata.max_num_logprobs = 2  # logprobs read the processed values: float32
    assert sampler.process_logits(logits, rows, step, metadata).dtype == torch.float32
    metadata.max_num_logprobs, metadata.all_greedy = None, False  # sampling: float32
    assert sampler.process_logits(logits, rows, step, metadata).dtype == torch.float32
