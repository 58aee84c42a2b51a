"""A scripted DFlash drafter for end-to-end tests.

A random drafter accepts nothing, so tests script the drafter's per-depth
distribution instead: knowing the target's greedy continuation (from a first
non-speculative run), the true token for depth d sits at a chosen rank of the
drafter's distribution, or is absent. The DFlash model still runs (its KV and
context handling are exercised); only its logits are replaced.

The script reaches the engine's worker whichever way vLLM starts it:

- spawned (vLLM's CPU backend): the test writes the script to a JSON file and
  puts a throwaway distribution on the path (sys.path, which spawned children
  inherit, and PYTHONPATH) whose ``vllm.general_plugins`` entry point
  (:func:`plugin`) patches the proposer in every vLLM process that sees
  ``DDTREE_SCRIPTED_DRAFTER``;
- forked (vLLM on CUDA): the child inherits the test process's classes and
  its "plugins loaded" flag, so the entry point never runs there; the patch is
  therefore also applied in the test process itself (undone after the test).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_ddtree.runner.v1_proposer import DDTreeProposer

ABSENT = -1
# Log-probability gap between consecutive ranks: distinct, so no ties.
RANK_STEP = 3.0


def rank_rule_mixed(position: int, depth: int) -> int:
    """Deterministic pseudo-random rank: mostly 0, sometimes 1 or 2, or absent."""
    h = ((position * 2654435761 + depth * 40503) % 1000) / 1000
    if h < 0.8:
        return 0
    if h < 0.9:
        return 1
    if h < 0.95:
        return 2
    return ABSENT


def rank_step() -> float:
    """Logit gap between ranks: RANK_STEP, or DDTREE_SCRIPTED_RANK_STEP where a test
    wants a flatter drafter (one whose best small trees hold siblings)."""
    return float(os.environ.get(RANK_STEP_ENV, RANK_STEP))


def scripted_logprobs(
    true_tokens: list[int | None],  # token at depth 1..L, None past the reference
    rank_of: Callable[[int], int],  # depth -> rank of the true token, or ABSENT
    vocab: int,
) -> torch.Tensor:
    """``[L, vocab]`` log-probabilities with the true token at the chosen ranks."""
    depth_count = len(true_tokens)
    logits = torch.full((depth_count, vocab), -30.0)
    for d, true in enumerate(true_tokens, start=1):
        anchor = true if true is not None else 5
        rank = rank_of(d) if true is not None else ABSENT
        # Decoys: distinct tokens other than the true one, in a fixed order.
        decoys = [(anchor + 11 * (i + 1)) % vocab for i in range(4)]
        decoys = [t for t in decoys if t != anchor][:3]
        order = list(decoys)
        if rank != ABSENT:
            order.insert(rank, anchor)
        for r, tok in enumerate(order[:4]):
            logits[d - 1, tok] = -rank_step() * r - 0.05 * d
    return logits.log_softmax(dim=-1)


def rank_rule_siblings(position: int, depth: int) -> int:
    """Non-first siblings often, absences rarely: exercises ranks 1 and 2."""
    return [0, 1, 2, 0, 1, 0, 0, ABSENT][(position + depth) % 8]


RULES: dict[str, Callable[[int, int], int]] = {
    "mixed": rank_rule_mixed,
    "siblings": rank_rule_siblings,
}
ENV = "DDTREE_SCRIPTED_DRAFTER"
RANK_STEP_ENV = "DDTREE_SCRIPTED_RANK_STEP"
TREE_LOG_ENV = "DDTREE_TREE_LOG_DIR"
REPO_ROOT = Path(__file__).resolve().parent.parent


def install(
    monkeypatch,
    tmp_dir: Path,
    references: dict[tuple[int, ...], list[int]],  # prompt ids -> greedy output ids
    rule: str = "mixed",
) -> None:
    """Script the drafter of every engine started afterwards in this test."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    script = tmp_dir / "script.json"
    script.write_text(
        json.dumps({"rule": rule, "refs": [[list(p), o] for p, o in references.items()]})
    )
    _install_plugin(monkeypatch, tmp_dir)
    monkeypatch.setenv(ENV, str(script))
    monkeypatch.setattr(DDTreeProposer, "_sample_draft_tokens", _scripted_sampler(script))
    speculator = _v2_speculator()
    if speculator is not None:  # vLLM 0.33 on CUDA: the V2 runner's drafter too
        monkeypatch.setattr(speculator, "draft_logprobs", _scripted_v2_logprobs(script))
        monkeypatch.setattr(speculator, "init_cudagraph_manager", _eager_draft_graphs(
            speculator.init_cudagraph_manager))


def install_tree_log(monkeypatch, tmp_dir: Path) -> Path:
    """Make every vLLM process log a digest of each tree it builds; returns the dir."""
    log_dir = tmp_dir / "tree-log"
    log_dir.mkdir(parents=True, exist_ok=True)
    _install_plugin(monkeypatch, tmp_dir)
    monkeypatch.setenv(TREE_LOG_ENV, str(log_dir))
    monkeypatch.setattr(DDTreeProposer, "propose", _logging_propose(DDTreeProposer.propose, log_dir))
    return log_dir


def _install_plugin(monkeypatch, tmp_dir: Path) -> None:
    dist = tmp_dir / "ddtree_scripted_drafter-0.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: ddtree-scripted-drafter\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nddtree_scripted = tests.scripted_drafter:plugin\n"
    )
    path = os.pathsep.join(
        p for p in (str(tmp_dir), str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
    )
    monkeypatch.setenv("PYTHONPATH", path)
    # Spawned children take the parent's sys.path, not PYTHONPATH.
    monkeypatch.syspath_prepend(str(tmp_dir))


def plugin() -> None:
    """vLLM plugin entry point: patch the proposer when asked to (idempotent)."""
    if os.environ.get(TREE_LOG_ENV) and not hasattr(DDTreeProposer.propose, "logs_trees"):
        DDTreeProposer.propose = _logging_propose(
            DDTreeProposer.propose, Path(os.environ[TREE_LOG_ENV])
        )
    if os.environ.get(ENV):
        DDTreeProposer._sample_draft_tokens = _scripted_sampler(Path(os.environ[ENV]))
        speculator = _v2_speculator()
        if speculator is not None and not hasattr(speculator.draft_logprobs, "scripted"):
            speculator.draft_logprobs = _scripted_v2_logprobs(Path(os.environ[ENV]))
            speculator.init_cudagraph_manager = _eager_draft_graphs(
                speculator.init_cudagraph_manager)


def _v2_speculator():
    """The V2 runner's DDTree speculator class where DDTree can run on that runner
    (vLLM 0.33; runner/v2.py), else None."""
    import vllm

    if not vllm.__version__.startswith("0.33."):
        return None
    try:
        from vllm_ddtree.runner.v2_speculator import DDTreeSpeculator
    except ImportError:
        return None
    return DDTreeSpeculator


def _eager_draft_graphs(original):
    """The scripted distributions are made on the host, which a CUDA graph cannot
    replay: the V2 drafter runs eagerly (the target keeps its graphs)."""

    def init_cudagraph_manager(self, cudagraph_mode):
        from vllm.config.compilation import CUDAGraphMode

        return original(self, CUDAGraphMode.NONE)

    return init_cudagraph_manager


def _load_script(script_path: Path):
    """A function (full token ids of the request, its bonus token's position, depth,
    vocab) -> the scripted ``[depth, vocab]`` log-probabilities."""
    script = json.loads(script_path.read_text())
    rank_rule = RULES[script["rule"]]

    def rows(full: list[int], bonus_pos: int, depth: int, vocab: int) -> torch.Tensor:
        true = [full[bonus_pos + d] if bonus_pos + d < len(full) else None
                for d in range(1, depth + 1)]
        return scripted_logprobs(true, lambda d: rank_rule(bonus_pos, d), vocab)

    return {tuple(p): o for p, o in script["refs"]}, rows


def _scripted_v2_logprobs(script_path: Path):
    """DDTreeSpeculator.draft_logprobs that returns the script's distributions."""
    references, script_rows = _load_script(script_path)

    def draft_logprobs(self, hidden_states, num_reqs):
        depth = self.ddtree.max_depth
        vocab = self.ddtree.vocab_size
        bonus_positions = self.input_buffers.positions[self._root_rows[:num_reqs]].tolist()
        states = self.sample_idx_mapping[: num_reqs * depth : depth].tolist()
        rows = []
        for state, bonus_pos in zip(states, bonus_positions, strict=True):
            full: list[int] = []
            if state >= 0:
                prompt_len = int(self.req_states.prompt_len.np[state])
                prompt = tuple(self.req_states.all_token_ids.gpu[state, :prompt_len].tolist())
                full = list(prompt) + references.get(prompt, [])
            rows.append(script_rows(full, bonus_pos, depth, vocab))
        return torch.stack(rows).to(hidden_states.device)

    draft_logprobs.scripted = True
    return draft_logprobs


def _scripted_sampler(script_path: Path):
    """DDTreeProposer._sample_draft_tokens that returns the script's distributions."""
    references, script_rows = _load_script(script_path)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        depth = self.ddtree.max_depth
        vocab = self.ddtree.vocab_size
        num_reqs = hidden_states.shape[0] // depth
        rows = []
        for r in range(num_reqs):
            req_id = self.runner.input_batch.req_ids[r]
            prompt = tuple(self.runner.requests[req_id].prompt_token_ids)
            full = list(prompt) + references.get(prompt, [])  # unscripted: no truth
            bonus_pos = int(self.positions[r * self.ddtree.block_size])
            rows.append(script_rows(full, bonus_pos, depth, vocab))
        logprobs = torch.cat(rows).to(hidden_states.device)
        self._draft_logprobs = logprobs
        return logprobs.argmax(dim=-1), None

    return _sample_draft_tokens


def _logging_propose(original, log_dir: Path):
    """DDTreeProposer.propose that appends a digest of its trees to a per-process file."""

    def propose(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        tree = self.last_tree
        if tree is not None:
            digest = [tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()]
            with open(log_dir / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(digest) + "\n")
        return result

    propose.logs_trees = True
    return propose
