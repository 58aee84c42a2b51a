"""The vLLM 0.33 V2-runner internals that vllm_ddtree/runner/v2*.py
and patches._patch_v2_model_runner rely on: names, parameters and fields, checked
against the installed vLLM wherever it is 0.33 (the GPU machine's kit; or, on a CPU
machine, 0.33's Python modules put first on PYTHONPATH). A vLLM release that moves
one of them fails here, by name, before any engine starts.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.skipif(
    not vllm.__version__.startswith("0.33."), reason="the V2 path is written for vLLM 0.33"
)


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def assigns(cls, *names: str) -> None:
    source = inspect.getsource(cls)
    missing = [n for n in names if f"self.{n} =" not in source and f"self.{n}:" not in source]
    assert not missing, f"{cls.__name__} no longer sets {missing}"


def test_model_runner_points():
    from vllm.v1.worker.gpu import model_runner as v2

    cls = v2.GPUModelRunner
    assert params(v2.init_speculator) == ["vllm_config", "device", "req_states"]
    assert params(cls.__init__)[:3] == ["self", "vllm_config", "device"]
    assert params(cls.prepare_attn) == ["self", "input_batch"]
    assert params(cls.sample_tokens) == ["self", "grammar_output"]
    for name in ("load_model", "initialize_kv_cache"):
        assert callable(getattr(cls, name))
    assigns(cls, "speculator", "sampler", "rejection_sampler", "execute_model_state",
            "req_states", "use_pp", "speculative_config", "model_config", "max_num_reqs",
            "compilation_config", "kv_cache_config", "dtype")
    # The step's order: prepare_attn (slot mappings from sequential positions), then
    # the target's metadata build through the model state, with for_capture named.
    execute = inspect.getsource(cls.execute_model)
    assert execute.index("self.prepare_attn(input_batch)") < execute.index(
        "self.model_state.prepare_attn(")
    assert "for_capture=" in execute
    sample = inspect.getsource(cls.sample)
    assert "self.rejection_sampler(" in sample and "invalid_drafts" in sample
    # sample_tokens hands the step's state on before sampling, then drafts after.
    tokens = inspect.getsource(cls.sample_tokens)
    assert tokens.index("self.execute_model_state = None") < tokens.index("self.sample(")
    assert tokens.index("self.sample(") < tokens.index("self.speculator.propose(")
    assert "self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens" in tokens


def test_execute_state_and_input_batch_fields():
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState

    state_fields = set(ExecuteModelState._fields)  # a NamedTuple
    assert {"hidden_states", "aux_hidden_states", "slot_mappings_by_layer",
            "input_batch"} <= state_fields
    batch_fields = {f.name for f in dataclasses.fields(InputBatch)}
    used = {"num_reqs", "num_reqs_after_padding", "idx_mapping", "idx_mapping_np",
            "expanded_idx_mapping", "expanded_local_pos", "num_draft_tokens",
            "num_draft_tokens_per_req", "query_start_loc", "query_start_loc_np", "seq_lens",
            "seq_lens_cpu_upper_bound", "input_ids", "positions", "logits_indices",
            "cu_num_logits", "cu_num_logits_np", "has_structured_output_reqs"}
    assert used <= batch_fields, used - batch_fields


def test_sampler_points():
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    assert params(Sampler.sample) == [
        "self", "logits", "expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "pos",
        "input_ids", "expanded_local_pos", "seq_lens_upper_bound_np", "return_logprobs"]
    assert params(Sampler.get_logprobs_dims) == ["self", "idx_mapping_np", "include_token_ids"]
    assigns(Sampler, "compute_nans", "logits_processors", "needs_logits_processing",
            "penalties_state", "req_states", "logprobs_mode")
    assigns(PenaltiesState, "use_penalty")
    assigns(BadWordsState, "num_bad_words")
    from vllm.v1.worker.gpu.sample.thinking_budget import ThinkingBudgetState

    assigns(ThinkingBudgetState, "enabled", "use_thinking_budget")
    assigns(Sampler, "thinking_budget_state")
    assert params(RejectionSampler.__call__) == [
        "self", "logits", "input_batch", "draft_logits", "invalid_drafts"]
    assert params(get_num_sampled_and_rejected) == [
        "num_sampled", "seq_lens", "cu_num_logits", "idx_mapping", "prefill_len"]
    assert params(compute_topk_scores)[:4] == [
        "logits", "num_logprobs", "sampled_token_ids", "cu_num_logits"]
    assert "logits_mode" in params(compute_topk_scores)
    assert {f.name for f in dataclasses.fields(SamplerOutput)} >= {
        "sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected"}


def test_dflash_speculator_points():
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.states import RequestState

    assert params(DFlashSpeculator.__init__) == ["self", "vllm_config", "device"]
    assert params(DFlashSpeculator._generate_draft) == [
        "self", "num_reqs", "num_tokens_padded", "attn_metadata", "slot_mappings",
        "num_tokens_across_dp", "cudagraph_runtime_mode"]
    assert params(DFlashSpeculator._run_model)[1:] == [
        "num_tokens", "attn_metadata", "slot_mappings", "num_tokens_across_dp",
        "cudagraph_runtime_mode"]
    assert params(DFlashSpeculator._num_graph_context_tokens) == ["self", "num_reqs"]
    assert params(DFlashSpeculator.init_cudagraph_manager) == ["self", "cudagraph_mode"]
    propose = params(DFlashSpeculator.propose)
    assert propose[1] == "input_batch"
    assert {"dummy_run", "num_speculative_tokens", "dp_sync_state"} <= set(propose)
    assigns(DFlashSpeculator, "sample_indices", "sample_idx_mapping", "num_query_per_req",
            "hidden_states")
    # The context the drafter stores for a FULL graph is sized by this hook.
    assert "_num_graph_context_tokens(" in inspect.getsource(DFlashSpeculator.__init__)
    # A pass without drafts stores the hidden states, then the context K/V from row 0,
    # and returns (v2_speculator.py holds both calls and replays them as a graph).
    assert params(DFlashSpeculator._store_hidden_states)[:4] == [
        "self", "num_tokens", "last_hidden_states", "aux_hidden_states"]
    assert params(DFlashSpeculator._precompute_context_kv) == [
        "self", "start", "end", "dummy_run"]
    branch = inspect.getsource(DFlashSpeculator.propose).split(
        "if num_speculative_tokens == 0:", 1)[1].split("return", 1)[0]
    assert ("self._store_hidden_states(" in branch and "num_target_tokens, last_hidden_states"
            in " ".join(branch.split()) and "self._precompute_context_kv(0, num_target_tokens"
            in branch)
    assigns(RequestState, "prompt_len", "prefill_len", "all_token_ids", "draft_tokens")


def test_speculative_config_fields_the_v2_path_checks():
    from vllm.config import SpeculativeConfig

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert {"rejection_sample_method", "draft_sample_method",
            "enable_adaptive_verification", "num_speculative_tokens"} <= fields


def test_worker_builds_the_runner_in_one_place():
    from vllm.v1.worker.gpu_worker import Worker

    assert params(Worker._make_model_runner) == ["self"]
    assert "self.use_v2_model_runner" in inspect.getsource(Worker._make_model_runner)


def test_the_profilers_v2_calls_exist():
    """benchmarks/profile_gpu_step.py times these V2 calls; PhaseTimer skips a missing
    one, so a rename would only thin the profile out: caught here instead."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_gpu_step as prof

    missing = []
    for module_name, class_name, attr in prof.TIMED:
        if not module_name.startswith("vllm.v1.worker.gpu."):
            continue
        owner = importlib.import_module(module_name)
        if class_name is not None:
            owner = getattr(owner, class_name)
        if attr not in owner.__dict__:
            missing.append(f"{module_name}:{class_name}.{attr}")
    assert not missing


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="vLLM's kernel needs CUDA")
def test_the_walk_counts_as_vllms_get_num_sampled_and_rejected():
    """The V2 runner takes the step's counts from the walk's launch (ops.walk.walk_rows),
    which writes vLLM's rule itself: the same numbers as vLLM's own kernel, a request
    still prefilling its prompt included."""
    import torch
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected

    from vllm_ddtree.ops.walk import walk_rows
    from vllm_ddtree.tensors import DDTree

    cuda = {"device": "cuda"}
    num_reqs, width = 3, 4
    chain = torch.arange(width, **cuda).expand(num_reqs, width)
    tree = DDTree(tokens=chain.clone(), parents=(chain - 1).clamp(min=0),
                  depths=chain.clone(), valid=torch.ones(num_reqs, width, dtype=torch.bool, **cuda),
                  ancestor_mask=torch.ones(num_reqs, width, width, dtype=torch.bool, **cuda),
                  num_nodes=torch.full((num_reqs,), width - 1, **cuda))
    scheduled = torch.full((num_reqs,), width - 1, **cuda)
    cu = torch.arange(num_reqs + 1, dtype=torch.int32, **cuda) * width
    # Request 0 accepts 2 drafts, 1 accepts all 3, 2 is still prefilling.
    row_tokens = torch.tensor([1, 2, 0, 0, 1, 2, 3, 0, 1, 2, 3, 0], **cuda)
    seq_lens = torch.tensor([30, 40, 8], dtype=torch.int32, **cuda)
    idx_mapping = torch.tensor([2, 0, 1], **cuda)
    prefill_len = torch.tensor([10, 20, 5], dtype=torch.int32, **cuda)
    counts = torch.zeros(2, num_reqs, dtype=torch.int32, **cuda)
    walk = walk_rows(tree, row_tokens, cu[1:], scheduled, 3, counts[0],
                     num_rejected_out=counts[1],
                     chunked_prefill=(seq_lens, idx_mapping, prefill_len))
    assert walk.num_accepted.tolist()[:2] == [2, 3]
    vllm_sampled, vllm_rejected = get_num_sampled_and_rejected(
        (walk.num_accepted + 1).to(torch.int32), seq_lens, cu, idx_mapping, prefill_len)
    assert counts[0].tolist() == vllm_sampled.tolist() == [3, 4, 0]
    assert counts[1].tolist() == vllm_rejected.tolist() == [1, 0, 0]


def test_the_step_graphs_inputs_stay_put_or_are_in_their_signature():
    """The V2 runner's step graphs replay over fixed addresses: the batch tensors they read
    are views of vLLM's persistent input buffers (or are copied: idx_mapping and
    cu_num_logits, made anew each step), and ``prefill_len.gpu``, which vLLM moves
    among UVA buffers, is in the walk graph's signature."""
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor

    source = inspect.getsource(v2.GPUModelRunner.prepare_inputs)
    for name in ("input_ids", "positions"):
        assert f"{name}=self.input_buffers.{name}[" in source, name
    assert "seq_lens = self.input_buffers.seq_lens[" in source
    assert "query_start_loc = self.input_buffers.query_start_loc" in source
    assert "self.gpu = self.pool.copy_to_uva(" in inspect.getsource(UvaBackedTensor)


def test_what_the_steps_host_shortcuts_assume():
    """The V2 runner's per-step shortcuts rest on three facts of vLLM 0.33's V2 runner:
    every request a logits processor or thinking budget reads is marked in
    ``needs_logits_processing`` (tree_allowed's fast path); a request's logits rows
    are its last query rows, in order (logits_row_inputs' slices); and the drafter's
    pass that follows the sampler drafts over the sampler's batch (the walk graph maps
    the speculator's rows for it)."""
    import re

    from vllm.v1.worker.gpu import input_batch as batch_module
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    add = inspect.getsource(Sampler.add_request)
    assert "needs_processing |= processor.add_request(req_idx, sampling_params)" in add
    assert "needs_processing |= self.thinking_budget_state.add_request(" in add
    assert "self.needs_logits_processing[req_idx] = needs_processing" in add
    kernel = batch_module._combine_sampled_and_draft_tokens_kernel
    kernel = inspect.getsource(getattr(kernel, "fn", kernel))  # a Triton JIT function, or not
    assert "logits_start = query_end - num_logits" in kernel
    assert "logits_indices_ptr + cu_num_logits_start + block" in kernel
    tokens = inspect.getsource(v2.GPUModelRunner.sample_tokens)
    assert re.search(r"self\.speculator\.propose\(\s*input_batch,", tokens)
    assert tokens.count("self.sample(") == 1 and tokens.count("self.speculator.propose(") == 1
