"""The code cites documents in the repository only, and every docs/DESIGN.md section it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import steadyrl

ROOT = Path(steadyrl.__file__).parent.parent
SOURCES = sorted((ROOT / "steadyrl").rglob("*.py"))


def _flat(path: Path) -> str:
    """The file as one line: comment markers, string-concatenation seams and line breaks removed."""
    text = re.sub(r'"\s*\n\s*"', "", path.read_text())
    text = re.sub(r"\n\s*#", " ", text)
    return re.sub(r"\s+", " ", text)


def test_no_citation_of_the_design_notes_outside_the_repository() -> None:
    assert [str(p) for p in SOURCES if re.search(r"seed 00\d", p.read_text(), re.I)] == []


def test_every_cited_design_section_exists() -> None:
    headings = [h.strip() for h in re.findall(r"^## (.+)$", (ROOT / "docs" / "DESIGN.md").read_text(), re.M)]
    layers = {h.split(":")[0] for h in headings}
    missing = []
    for path in SOURCES:
        for after in re.findall(r"DESIGN\.md(.{0,80})", _flat(path)):
            rest = after.lstrip(',: "')
            group = re.match(r'the "(\w+)" sections', rest)
            if rest.startswith(")") or (group and group[1] in layers):
                continue  # the whole page, or all sections of one layer
            if not any(rest.startswith(h) for h in headings):
                missing.append(f"{path.relative_to(ROOT)}: DESIGN.md{after[:50]}")
    assert missing == []
