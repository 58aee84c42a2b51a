"""The docs against the repository: the results tables are what benchmarks/render_docs.py
renders from benchmarks/results/ today, every file they cite exists, and every relative
link resolves. Nothing here reads the prose."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
RESULTS_PATH = re.compile(r"benchmarks/results/[\w\-]+(?:\.[\w\-]+)*\.(?:json|png|txt|log)")


@pytest.fixture(scope="module")
def render_docs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_docs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return render_docs


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def strip_code(text: str) -> str:
    """The text outside fenced blocks (links in code are not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", strip_code(path.read_text()), flags=re.MULTILINE)
    return {slug(h) for h in headings}


def test_results_blocks_are_current(render_docs):
    """`python benchmarks/render_docs.py --check` passes: no block is stale."""
    assert render_docs.stale_blocks() == [], "run: python benchmarks/render_docs.py"


def test_every_renderer_has_a_block(render_docs):
    used = {name for path in render_docs.DOCS
            for name in render_docs.OPENING.findall(path.read_text())}
    assert used == set(render_docs.RENDERERS)


def test_the_readme_shows_the_real_pair(render_docs):
    assert render_docs.OPENING.findall((ROOT / "README.md").read_text()) == ["readme-h200"]


def test_check_names_a_stale_block(render_docs, tmp_path, capsys, monkeypatch):
    """--check exits 1 and names the block when a table was edited by hand."""
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- results:gpu-step -->\n| hand | made |\n<!-- /results:gpu-step -->\n")
    monkeypatch.setattr(render_docs, "DOCS", (doc,))
    monkeypatch.setattr(render_docs, "ROOT", tmp_path)
    assert render_docs.main(["--check"]) == 1
    assert "doc.md: gpu-step" in capsys.readouterr().out
    assert render_docs.main([]) == 0
    assert render_docs.main(["--check"]) == 0


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_cited_results_files_exist(doc):
    missing = sorted({p for p in RESULTS_PATH.findall(doc.read_text())
                      if not (ROOT / p).is_file()})
    assert not missing, f"cited but not in the repository: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_relative_links_resolve(doc):
    """Every link and image that is not a URL names a file (and heading) that exists."""
    broken = []
    for target in LINK.findall(strip_code(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        missing_anchor = bool(anchor) and file.suffix == ".md" and anchor not in anchors(file)
        if not file.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{doc_id(doc)}: links that do not resolve: {broken}"


@pytest.mark.parametrize("name", ["e2e_h200_b89fd64_pooled.json",
                                  "e2e_h200_stepgraphs_pooled.json"])
def test_pooled_files_are_what_pool_computes(name, tmp_path, monkeypatch):
    """A pooled results file is bench_e2e's --pool of the runs it names, so a re-run or an
    edited input shows here before it reaches a table."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_e2e
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    saved = json.loads((RESULTS / name).read_text())
    monkeypatch.chdir(RESULTS)  # the file names its inputs relative to benchmarks/results
    bench_e2e.pool([Path(f) for f in saved["files"]], tmp_path / "p.json", saved["target"])
    assert json.loads((tmp_path / "p.json").read_text()) == saved
