"""training/corpus.py: prompt files in every accepted form, and a held-out split that
shares no prompt and no group (template) with training."""

from __future__ import annotations

import json

import pytest

from training.corpus import Prompt, read_prompts, split_heldout
from training.prompts import build_prompt_records, build_prompts


def test_json_list_of_strings(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["a", "b", "a"]))
    assert read_prompts(f) == [Prompt("a", "text:a"), Prompt("b", "text:b")]


def test_json_records_with_groups(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"prompt": "x", "group": "t1"}, {"text": "y", "template": 3}]))
    assert read_prompts(f) == [Prompt("x", "t1"), Prompt("y", "3")]


def test_json_lines_and_text_lines(tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text('"first"\n\n{"prompt": "second", "group": "g"}\n')
    assert read_prompts(jl) == [Prompt("first", "text:first"), Prompt("second", "g")]
    txt = tmp_path / "p.txt"
    txt.write_text("one prompt\n\n  another one  \n")
    assert [p.text for p in read_prompts(txt)] == ["one prompt", "  another one  "]


@pytest.mark.parametrize("content,match", [
    ("[]", "no prompts"), ('{"a": 1}', "a JSON list"), ('[1]', "non-empty string"),
    ('[{"group": "g"}]', "'prompt' string"),
])
def test_bad_files_name_the_problem(tmp_path, content, match):
    f = tmp_path / "p.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_prompts(f)


def test_split_takes_whole_groups_and_ignores_order():
    groups = [f"g{i % 20}" for i in range(200)]
    held = split_heldout(groups, 0.2, seed=0)
    assert 0 < len(held) < 20
    assert held == split_heldout(list(reversed(groups)), 0.2, seed=0)
    assert held != split_heldout(groups, 0.2, seed=1)


def test_split_keeps_both_sides_non_empty():
    assert len(split_heldout(["a", "b"], 0.001, 0)) == 1
    assert len(split_heldout(["a", "b"], 0.999, 0)) == 1
    with pytest.raises(ValueError, match="at least two groups"):
        split_heldout(["a", "a"], 0.5, 0)
    with pytest.raises(ValueError, match=r"heldout_frac=1\.5"):
        split_heldout(["a", "b"], 1.5, 0)


def test_builtin_corpus_split_shares_no_template_or_prompt():
    """The built-in corpus (the smollm2 preset's) names each prompt's template; the
    split holds out whole templates, and build_prompts is the same list as before."""
    records = build_prompt_records()
    assert [r["prompt"] for r in records] == build_prompts()
    held = split_heldout([r["group"] for r in records], 0.1, seed=0)
    train = [r for r in records if r["group"] not in held]
    test = [r for r in records if r["group"] in held]
    assert train and test
    assert not {r["group"] for r in train} & {r["group"] for r in test}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_stdlib_functions_add_real_code_grouped_by_module():
    """``--functions N``: N stdlib functions (and methods), four prompts each, grouped
    by module, after the unchanged built-in corpus; the split holds out whole modules."""
    from training.prompts import FUNCTION_FORMS, stdlib_functions

    functions = stdlib_functions()
    assert len(functions) > 2000 and len({f["module"] for f in functions}) > 150
    assert all(f["source"].startswith("def ") for f in functions)  # methods dedented
    records = build_prompt_records(functions=300)
    base = build_prompt_records()
    assert records[: len(base)] == base
    added = records[len(base):]
    assert len(added) == 300 * len(FUNCTION_FORMS)
    assert all(r["group"].startswith("lib:") for r in added)
    assert len({r["group"] for r in added}) > 50
    held = split_heldout([r["group"] for r in records], 0.1, seed=0)
    train = {r["prompt"] for r in records if r["group"] not in held}
    assert train and not train & {r["prompt"] for r in records if r["group"] in held}
    assert build_prompt_records(functions=300) == records  # deterministic


def test_prompts_command_writes_the_larger_corpus(tmp_path, capsys):
    from training.prompts import main

    main([str(tmp_path / "p.json"), "--functions", "50"])
    records = json.loads((tmp_path / "p.json").read_text())
    assert sum(r["group"].startswith("lib:") for r in records) == 200
    assert "prompts in" in capsys.readouterr().out
