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


def _tokenizer_json(path, vocab):
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    return path


def test_vocabulary_words_keep_whole_words_of_either_marker(tmp_path):
    """Word-initial tokens of 5-12 lower-case letters whose capitalized form is a
    token too (word pieces rarely are); byte-level BPE's and SentencePiece's markers;
    a Unigram vocabulary's [piece, score] list."""
    from training.prompts import vocabulary_words

    g, s = "\u0120", "\u2581"
    vocab = {f"{g}castle": 0, f"{g}Castle": 1, f"{g}includ": 2,  # a piece: no capital
             f"{g}tiny": 3, f"{g}Tiny": 4,  # too short
             f"{g}caf\u00e9s": 5, f"{g}Caf\u00e9s": 6,  # not ASCII
             "castle": 7, f"{s}garden": 8, f"{s}Garden": 9, f"{g}gardens": 10,
             f"{g}Gardens": 11, f"{g}extraordinarily": 12, f"{g}Extraordinarily": 13}
    words = vocabulary_words(_tokenizer_json(tmp_path / "t.json", vocab))
    assert words == ["castle", "garden", "gardens"]
    unigram = [[piece, -1.0] for piece in vocab]
    assert vocabulary_words(_tokenizer_json(tmp_path / "u.json", unigram)) == words


def test_word_prompts_follow_the_functions_grouped_by_form(tmp_path):
    """``--words N --vocab``: N distinct requests after the rest of the corpus, one
    group per form, deterministic; the split holds out whole forms."""
    from training.prompts import WORD_FORMS

    g = "\u0120"
    words = ["castle", "garden", "river", "engine", "violin", "planet", "harbor", "pepper"]
    vocab = {f"{g}{w}": i for i, w in enumerate(words)}
    vocab |= {f"{g}{w.capitalize()}": 100 + i for i, w in enumerate(words)}
    path = _tokenizer_json(tmp_path / "t.json", vocab)
    base = build_prompt_records(functions=20)
    records = build_prompt_records(functions=20, words=300, vocab=path)
    assert records[: len(base)] == base
    added = records[len(base):]
    assert len(added) == len({r["prompt"] for r in added}) == 300
    assert {r["group"] for r in added} == {f"words:{k}" for k in range(len(WORD_FORMS))}
    assert all(any(w in r["prompt"] for w in words) for r in added)
    assert build_prompt_records(functions=20, words=300, vocab=path) == records
    held = split_heldout([r["group"] for r in records], 0.2, seed=0)
    train = {r["prompt"] for r in records if r["group"] not in held}
    assert train and not train & {r["prompt"] for r in records if r["group"] in held}
    with pytest.raises(ValueError, match="vocab"):
        build_prompt_records(words=10)


def test_prompts_command_needs_a_vocabulary_for_words(tmp_path, capsys):
    from training.prompts import main

    with pytest.raises(SystemExit):
        main([str(tmp_path / "p.json"), "--words", "10"])
    assert "--words needs --vocab" in capsys.readouterr().err
