"""Every ``NOTE [ Title ]`` reference names a note defined exactly once.

A note is defined by a line holding only ``NOTE [ Title ]`` (in a docstring or after ``#``)
and referenced anywhere else, in any case and across a line break; see docs/architecture.md.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "tests", "benchmarks", "scripts", "examples", "docs")
DEFINITION = re.compile(r'^\s*(?:#\s*)?(?:"""|r""")?NOTE \[ ([^\]]+?) \]\s*:?\s*$')
REFERENCE = re.compile(r"(?i:note) \[ ([^\]]+?) \]")
LINE_BREAK = re.compile(r"\s*\n\s*(?:#:?\s*)?")


def _files() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in FOLDERS:
        found += [p for p in (ROOT / folder).rglob("*")
                  if p.suffix in (".py", ".md") and ".egg-info" not in str(p)
                  and p != Path(__file__).resolve()]
    return sorted(found)


def _notes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    definitions: dict[str, list[str]] = defaultdict(list)
    references: dict[str, list[str]] = defaultdict(list)
    for path in _files():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        kept = []
        for number, line in enumerate(text.splitlines(), 1):
            match = DEFINITION.match(line)
            if match:
                definitions[match.group(1)].append(f"{where}:{number}")
                kept.append("")
            else:
                kept.append(line)
        for match in REFERENCE.finditer(LINE_BREAK.sub(" ", "\n".join(kept))):
            references[" ".join(match.group(1).split())].append(where)
    return definitions, references


def test_every_note_is_defined_once() -> None:
    definitions, _ = _notes()
    twice = {title: places for title, places in definitions.items() if len(places) > 1}
    assert not twice, f"notes defined more than once: {twice}"
    assert len(definitions) > 100  # the scan finds the tree's notes


def test_every_reference_names_a_defined_note() -> None:
    definitions, references = _notes()
    dangling = {title: places for title, places in references.items()
                if title not in definitions}
    assert not dangling, f"references to notes nobody defines: {dangling}"
    assert sum(map(len, references.values())) > 100


PLACED = re.compile(r"(?i:note) \[ ([^\]]+?) \],? in (?:``)?([\w./]+\.(?:py|md))")


def test_a_reference_that_names_a_file_names_the_definitions_file() -> None:
    # "NOTE [ X ] in planning/loop.py" sends the reader to a file: it must be the one
    # that defines X (a suffix of its path), not a file the note has moved out of.
    definitions, _ = _notes()
    wrong: list[str] = []
    for path in _files():
        text = LINE_BREAK.sub(" ", path.read_text())
        for match in PLACED.finditer(text):
            title, named = " ".join(match.group(1).split()), match.group(2)
            places = [p.split(":")[0] for p in definitions.get(title, [])]
            if places and not any(p.endswith(named) for p in places):
                wrong.append(f"{path.relative_to(ROOT)}: NOTE [ {title} ] in {named}, "
                             f"defined in {places[0]}")
    assert wrong == [], "references naming the wrong file:\n" + "\n".join(sorted(set(wrong)))
