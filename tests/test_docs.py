"""The benchmark docs stay a short results page with dated notes behind it (issue 41).

Plain file reading: ``docs/benchmarks.md`` is at most 400 lines; every relative link of the docs and READMEs
reaches a file; every note is linked from the results page or another note and listed in the notes' index;
and every section of the results page that holds a table also names the command that produced it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "benchmarks.md"
NOTES = ROOT / "docs" / "notes"
INDEX = NOTES / "README.md"

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
COMMAND = ("uv run", "ce-bench", "python")


def _notes() -> list[Path]:
    return sorted(p for p in NOTES.glob("*.md") if p != INDEX)


def _linked_files(doc: Path) -> list[tuple[str, Path]]:
    """The targets of ``doc``'s relative markdown links (code left out), each as written and as a path."""
    text = CODE_SPAN.sub("", FENCE.sub("", doc.read_text()))
    found = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        found.append((target, (doc.parent / target.split("#", 1)[0]).resolve()))
    return found


def _sections(doc: Path) -> list[tuple[str, list[str]]]:
    """``doc``'s ``##`` and ``###`` sections: each heading with the lines up to the next such heading."""
    sections: list[tuple[str, list[str]]] = []
    for line in doc.read_text().splitlines():
        if re.match(r"^#{2,3} ", line):
            sections.append((line, []))
        elif sections:
            sections[-1][1].append(line)
    return sections


def test_the_results_page_is_at_most_400_lines() -> None:
    assert len(RESULTS.read_text().splitlines()) <= 400


@pytest.mark.parametrize(
    "doc",
    [RESULTS, *sorted(NOTES.glob("*.md")), ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_reach_a_file(doc: Path) -> None:
    broken = [target for target, path in _linked_files(doc) if not path.exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def test_every_note_is_linked_and_indexed() -> None:
    notes = _notes()
    assert notes, "docs/notes/ holds no notes"
    indexed = {path for _, path in _linked_files(INDEX)}
    for note in notes:
        others = {path for doc in [RESULTS, *notes] if doc != note for _, path in _linked_files(doc)}
        assert note.resolve() in others, f"{note.name} is linked from neither docs/benchmarks.md nor another note"
        assert note.resolve() in indexed, f"{note.name} is not listed in docs/notes/README.md"


def test_every_table_of_the_results_page_names_its_command() -> None:
    missing = [
        heading
        for heading, body in _sections(RESULTS)
        if any(TABLE_RULE.match(line) for line in body) and not any(c in line for line in body for c in COMMAND)
    ]
    assert not missing, f"sections with a table but no command line: {missing}"
