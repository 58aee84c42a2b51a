"""A deterministic offline prompt corpus for drafter training (no downloads).

Sources: the Zen of Python, the docstrings of a fixed list of stdlib modules, and
instruction-style prompts (code, math, chat, prose) generated from templates with
a seeded RNG; on request (``--functions N``) also N functions of the standard
library's own source, each asked for by its signature and docstring, explained and
tested (real code in its variety, grouped by module), and (``--words N --vocab
TOKENIZER_JSON``) N open requests of MT-Bench-like kinds around words of the target's
own vocabulary. The continuations come from the target model itself, so only the
prompts need to be varied; their quality matters little.

Each prompt carries the name of its template (``group``), so that the held-out split
(``training.corpus.split_heldout``) shares no template with training.

Docstrings differ between Python versions: build the file once with
``python -m training.prompts OUT.json`` (a JSON list of ``{"prompt", "group"}``) and
train from that file for exact reruns.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import contextlib
import functools
import importlib
import io
import json
import random
import sysconfig
import textwrap
from pathlib import Path

# Modules whose import has no side effects and whose docstring is informative.
STDLIB_MODULES = """
abc argparse array ast asyncio base64 bisect bz2 calendar cmath codecs collections
colorsys concurrent.futures configparser contextlib copy csv dataclasses datetime
decimal difflib dis email enum filecmp fnmatch fractions ftplib functools gc getopt
gettext glob graphlib gzip hashlib heapq hmac html html.parser http http.client
imaplib inspect io ipaddress itertools json keyword linecache locale logging lzma
mailbox math mimetypes numbers operator optparse os pathlib pickle pkgutil platform
plistlib poplib pprint profile pstats queue quopri random re reprlib sched secrets
selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl stat
statistics string stringprep struct subprocess symtable sysconfig tabnanny tarfile
tempfile textwrap threading timeit token tokenize trace traceback tracemalloc types
typing unicodedata unittest urllib.parse urllib.request uuid warnings wave weakref
xml.dom xml.etree.ElementTree xml.sax zipapp zipfile zlib zoneinfo
""".split()

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "merges two sorted lists", "counts the vowels in a string",
    "removes duplicates from a list while keeping order", "flattens a nested list",
    "finds the maximum element of a list without using max()", "checks if a string is a palindrome",
    "converts Celsius to Fahrenheit", "computes the greatest common divisor of two integers",
    "sorts a list of dictionaries by a key", "reads a CSV file and returns its rows",
    "counts word frequencies in a text", "implements binary search", "transposes a matrix",
    "validates an email address with a regular expression",
    "computes the mean and median of a list",
    "generates all permutations of a list", "implements bubble sort", "parses a date string",
    "returns the intersection of two lists", "capitalizes every word in a sentence",
    "computes the sum of the digits of an integer", "checks whether two strings are anagrams",
    "implements a stack class with push and pop", "implements a queue using two stacks",
    "finds the longest common prefix of a list of strings", "rotates a list by k positions",
    "converts a Roman numeral to an integer", "computes the power set of a set",
    "chunks a list into pieces of size n", "retries a function call up to three times",
    "memoizes a recursive function", "computes the distance between two points",
    "returns the second largest number in a list", "checks balanced parentheses in a string",
    "converts a binary string to an integer", "writes a dictionary to a JSON file",
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Rust", "Go", "Java"]
CODE_FORMS = [
    "Write a {lang} function that {task}.",
    "How do I write a {lang} function that {task}?",
    "Show me {lang} code that {task}, with a short explanation.",
    "Write a well-documented {lang} function that {task} and give an example call.",
]
SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "for i in range(10):\n    if i % 3 == 0:\n        print(i)",
    "d = {}\nfor w in text.split():\n    d[w] = d.get(w, 0) + 1",
    "def g(n):\n    return 1 if n <= 1 else n * g(n - 1)",
    "with open('data.txt') as fh:\n    lines = [l.strip() for l in fh]",
    "result = sorted(people, key=lambda p: p['age'], reverse=True)",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y",
    "def h(s):\n    return s == s[::-1]",
    "import os\nprint(os.listdir('.'))",
]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Kenya",
             "Mexico", "Norway", "Peru", "Spain", "Germany", "Australia", "Chile", "Greece"]
ACTIVITIES = ["learning to cook", "studying for exams", "running a marathon", "saving money",
              "sleeping better", "learning a new language", "starting a garden",
              "working from home", "traveling on a budget", "writing a resume",
              "staying focused", "public speaking", "making friends in a new city"]
HOWTOS = ["make a cup of tea", "change a flat tire", "write a cover letter",
          "plant tomatoes", "bake bread", "tie a tie", "start a blog", "learn to swim",
          "set up a Python virtual environment", "use git branches", "clean a laptop keyboard",
          "prepare for a job interview", "meditate", "back up my files"]
TOPICS = ["photosynthesis", "black holes", "the Roman Empire", "climate change", "volcanoes",
          "the internet", "machine learning", "the water cycle", "democracy", "electricity",
          "the human heart", "DNA", "the moon", "honeybees", "renewable energy", "gravity",
          "the printing press", "vaccines", "earthquakes", "the stock market"]
CHAT_FORMS = [
    "What is the capital of {country}?", "Tell me an interesting fact about {country}.",
    "Give me three tips for {activity}.", "What are the benefits of {activity}?",
    "How do I {howto}?", "Explain step by step how to {howto}.",
    "Tell me about {topic}.", "Explain {topic} to a ten-year-old.",
    "What are the main facts about {topic}?", "Why is {topic} important?",
]
CHARACTERS = ["a robot", "a young wizard", "an old fisherman", "a curious cat", "a detective",
              "a lost astronaut", "a baker", "a dragon", "a lighthouse keeper", "a little girl"]
ACTIONS = ["finds a hidden door", "learns to fly", "loses a key", "meets a stranger",
           "discovers a secret", "goes on a journey", "builds a machine", "saves a village"]
THINGS = ["the ocean", "autumn leaves", "the city at night", "friendship", "the stars",
          "a rainy day", "mountains", "the first snow", "time", "coffee"]
PROSE_FORMS = [
    "Write a short story about {char} who {action}.", "Write a poem about {thing}.",
    "Describe {thing} in a few sentences.", "Write a haiku about {thing}.",
    "Write a short email to a colleague about {activity}.",
    "Write a paragraph about {topic} for a school essay.",
    "Continue this story: Once upon a time, {char} {action}.",
]


def zen_lines() -> list[str]:
    """The 19 aphorisms of ``import this``."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # prints the Zen on first import
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def module_docs(max_chars: int = 600) -> list[tuple[str, str]]:
    """(name, first paragraphs of the docstring) for each importable module listed."""
    docs = []
    for name in STDLIB_MODULES:
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except Exception:  # missing optional module (e.g. no sqlite3): skip it
            continue
        doc = doc.strip()
        if len(doc) >= 40:
            docs.append((name, doc[:max_chars].rsplit("\n", 1)[0] if len(doc) > max_chars else doc))
    return docs


def math_prompt(rng: random.Random) -> tuple[str, str]:
    """A filled arithmetic template and its template's group name."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(100, 999)
    forms = [
        f"What is {a} + {b}?", f"What is {a} * {b}?", f"Compute {c} - {a}.",
        f"What is {c} divided by {b}? Give the answer with two decimals.",
        f"Solve for x: {a}x + {b} = {c}.", f"What is {a}% of {c}?",
        f"Is {c} a prime number? Explain.", f"What is the square root of {a * a}?",
        f"A shop sells apples for {a} cents each. How much do {b} apples cost?",
        f"A train travels {c} km in {b % 9 + 2} hours. What is its average speed?",
        f"Tom has {a} marbles and gives {b % a if b % a else 1} to Anna. How many are left?",
        f"What is the area of a rectangle with sides {a} cm and {b} cm?",
        f"Convert {c} minutes to hours and minutes.",
        f"What is the least common multiple of {a} and {b}?",
    ]
    k, text = rng.choice(list(enumerate(forms)))
    return text, f"math:{k}"


def instruction_prompts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """``n`` template prompts, about a quarter each of code, math, chat and prose, each
    with the name of its template (its group for the held-out split)."""
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            if rng.random() < 0.8:
                k, form = rng.choice(list(enumerate(CODE_FORMS)))
                text = form.format(lang=rng.choice(CODE_LANGS), task=rng.choice(CODE_TASKS))
                out.append((text, f"code:{k}"))
            else:
                snippet = f"Explain what this code does:\n```python\n{rng.choice(SNIPPETS)}\n```"
                out.append((snippet, "code:snippet"))
        elif kind == 1:
            out.append(math_prompt(rng))
        else:
            name, forms = ("chat", CHAT_FORMS) if kind == 2 else ("prose", PROSE_FORMS)
            k, form = rng.choice(list(enumerate(forms)))
            out.append((form.format(
                country=rng.choice(COUNTRIES), activity=rng.choice(ACTIVITIES),
                howto=rng.choice(HOWTOS), topic=rng.choice(TOPICS),
                char=rng.choice(CHARACTERS), action=rng.choice(ACTIONS),
                thing=rng.choice(THINGS)), f"{name}:{k}"))
    return out


FUNCTION_FORMS = [
    "Write a Python function `{name}({args})` that does the following:\n\n{doc}",
    "Explain what this Python function does, step by step:\n```python\n{source}\n```",
    "Write unit tests with pytest for this Python function:\n```python\n{source}\n```",
    ("Suggest improvements to this Python function and show the improved version:\n"
     "```python\n{source}\n```"),
]


@functools.lru_cache(maxsize=4)
def _stdlib_functions(max_lines: int, max_chars: int) -> tuple[dict[str, str], ...]:
    return tuple(_find_stdlib_functions(max_lines, max_chars))


def stdlib_functions(max_lines: int = 30, max_chars: int = 1200) -> list[dict[str, str]]:
    """Public functions and methods with a docstring in the standard library's own
    modules (``_find_stdlib_functions``), parsed once per process."""
    return [dict(f) for f in _stdlib_functions(max_lines, max_chars)]


def _find_stdlib_functions(max_lines: int, max_chars: int) -> list[dict[str, str]]:
    """Public functions and methods with a docstring in the standard library's own
    modules (the
    top-level ``.py`` files and packages of this Python's stdlib, tests left out):
    ``{"module", "name", "args", "doc", "source"}``, sorted, sources at most
    ``max_lines`` lines and ``max_chars`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"test", "tests", "idlelib", "site-packages", "lib2to3"}
                   & set(p.relative_to(root).parts))
    found = []
    for path in files:
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(
            ".__init__")
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
            lines = text.splitlines(keepends=True)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        # Module-level functions, and the methods of module-level classes.
        nodes = [(n, "") for n in tree.body] + [
            (m, f"{c.name}.") for c in tree.body if isinstance(c, ast.ClassDef)
            and not c.name.startswith("_") for m in c.body]
        for node, owner in nodes:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 30 or node.end_lineno - node.lineno >= max_lines:
                continue
            source = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
            # A docstring line left of the body keeps dedent from working: skip those.
            if len(source) > max_chars or not source.startswith("def "):
                continue
            source = source.rstrip()
            found.append({"module": module, "name": owner + node.name,
                          "args": ast.unparse(node.args), "doc": doc.split("\n\n")[0],
                          "source": source})
    return found


def function_prompts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """Prompts from ``n`` stdlib functions (fewer if the library has fewer), each in
    every form of FUNCTION_FORMS; the group is the module, so a held-out module shares
    no function with training."""
    functions = stdlib_functions()
    chosen = rng.sample(functions, min(n, len(functions)))
    return [(form.format(**f), f"lib:{f['module']}") for f in chosen for form in FUNCTION_FORMS]


# Open requests around one word (or two) of the target's own vocabulary: MT-Bench-like
# kinds (writing, role-play, explanation, comparison, reasoning) over thousands of
# words instead of a few hand-picked topics. The word is quoted, so a function word or
# a word piece still makes a request the target can answer.
WORD_FORMS = [
    'What does the word "{w}" mean? Explain it with two examples.',
    'Write a short story in which "{w}" matters.',
    'Write a poem inspired by the word "{w}".',
    'Use the word "{w}" in five sentences of different kinds.',
    'Write a dialogue between two friends about "{w}".',
    'Explain "{w}" to a ten-year-old.',
    'Write a blog post titled "Why {w} matters".',
    'Pretend you are a teacher and give a short lesson about "{w}".',
    'List five questions people might ask about "{w}", then answer the first one.',
    'Compare "{w}" and "{w2}": how are they alike, and how do they differ?',
    'Write a persuasive paragraph that mentions "{w}" and "{w2}".',
    'Tell a joke about "{w}" and explain why it is funny.',
    'Summarize what you know about "{w}" in three bullet points.',
    'Write a riddle whose answer is "{w}".',
    'Write a product description for something called "{w2} {w}".',
    'Describe a day in the life of someone who loves "{w}".',
    'Give a step-by-step plan for a school project about "{w}".',
    'Turn the idea of "{w}" into a metaphor and explain it.',
    'You are a travel guide in a town famous for "{w}". Describe a walk through it.',
    'Is "{w}" a good name for a pet? Give reasons for and against.',
]
# A word-start marker of the common tokenizers: byte-level BPE (GPT-2 style) and
# SentencePiece.
WORD_START = ("\u0120", "\u2581")


def vocabulary_words(tokenizer_json: str | Path, min_len: int = 5,
                     max_len: int = 12) -> list[str]:
    """Lower-case words of ``min_len``-``max_len`` letters that a tokenizer
    (``tokenizer.json`` of a Hugging Face fast tokenizer) has as word-initial tokens
    both as written and capitalized (which drops most word pieces), in vocabulary order."""
    vocab = json.loads(Path(tokenizer_json).read_text())["model"]["vocab"]
    if isinstance(vocab, list):  # Unigram models list [piece, score] pairs
        vocab = {piece: i for i, (piece, _score) in enumerate(vocab)}
    words = {}
    for token in vocab:
        for mark in WORD_START:
            word = token[len(mark):] if token.startswith(mark) else ""
            if (min_len <= len(word) <= max_len and word.isascii() and word.isalpha()
                    and word.islower() and mark + word.capitalize() in vocab):
                words[word] = True
    return list(words)


def word_prompts(rng: random.Random, n: int, words: list[str]) -> list[tuple[str, str]]:
    """``n`` requests of WORD_FORMS over ``words`` (distinct prompts, fewer if the
    words run out); the group is the form, so a held-out form shares none with
    training."""
    if len(words) < 2:
        raise ValueError("word prompts need at least two vocabulary words")
    out: dict[str, str] = {}
    for _ in range(20 * n):
        if len(out) >= n:
            break
        k = rng.randrange(len(WORD_FORMS))
        w, w2 = rng.sample(words, 2)
        out.setdefault(WORD_FORMS[k].format(w=w, w2=w2), f"words:{k}")
    return list(out.items())


def build_prompt_records(num_instructions: int = 2500, seed: int = 0, functions: int = 0,
                         words: int = 0, vocab: str | Path | None = None,
                         ) -> list[dict[str, str]]:
    """All prompts as ``{"prompt", "group"}`` records, deduplicated, in a fixed order.
    The group names the template (or the module of a stdlib function), so a held-out
    split by group shares no template with training (``training.corpus``).
    ``functions`` adds that many stdlib functions' prompts after the rest (0: the
    corpus the shipped drafter was trained on). ``words`` adds that many requests
    around words of the tokenizer ``vocab`` (its ``tokenizer.json``) after those."""
    rng = random.Random(seed)
    records: list[tuple[str, str]] = []
    for line in zen_lines():
        records.append((f"Explain this line from the Zen of Python: \"{line}\"", "zen:explain"))
        records.append((f"Give an example of Python code that follows the principle \"{line}\"",
                        "zen:example"))
    for name, doc in module_docs():
        records.append((f"What is the Python module `{name}` used for?", "module:purpose"))
        records.append((f"Summarize this documentation of the Python module `{name}`:\n\n{doc}",
                        "module:summary"))
        records.append((f"Write a short example that uses the Python module `{name}`.",
                        "module:example"))
    records += instruction_prompts(rng, num_instructions)
    if functions:
        records += function_prompts(random.Random(seed + 1), functions)
    if words:
        if vocab is None:
            raise ValueError("word prompts need a tokenizer's vocabulary (vocab)")
        records += word_prompts(random.Random(seed + 2), words, vocabulary_words(vocab))
    first = dict(reversed(records))  # text -> the group of its first occurrence
    return [{"prompt": text, "group": first[text]} for text in dict.fromkeys(t for t, _ in records)]


def build_prompts(num_instructions: int = 2500, seed: int = 0) -> list[str]:
    """All prompts, deduplicated, in a fixed order (user messages, no template)."""
    return [r["prompt"] for r in build_prompt_records(num_instructions, seed)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the built-in prompt corpus.")
    parser.add_argument("out", nargs="?", default="prompts.json")
    parser.add_argument("--functions", type=int, default=0,
                        help="add prompts from this many stdlib functions (4 each)")
    parser.add_argument("--words", type=int, default=0,
                        help="add this many open requests around words of --vocab")
    parser.add_argument("--vocab", metavar="TOKENIZER_JSON",
                        help="the target's tokenizer.json, the words' source")
    args = parser.parse_args(argv)
    if args.words and not args.vocab:
        parser.error("--words needs --vocab (the target's tokenizer.json)")
    records = build_prompt_records(functions=args.functions, words=args.words,
                                   vocab=args.vocab)
    with open(args.out, "w") as fh:
        json.dump(records, fh, indent=0)
    groups = len({r["group"] for r in records})
    print(f"{len(records)} prompts in {groups} template groups -> {args.out}")


if __name__ == "__main__":
    main()
