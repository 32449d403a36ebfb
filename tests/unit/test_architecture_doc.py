"""docs/ARCHITECTURE.md matches the code: every file, class member, test and mutant it names exists, and every code
line of its worked example is a line of the file the example names."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()
TICKED = re.findall(r"`([^`\n]+)`", DOC)


def _path(name: str) -> Path | None:
    """A cited file, as written (from the repo root) or relative to steadyrl/."""
    for base in (REPO, REPO / "steadyrl"):
        if (base / name).exists():
            return base / name
    return None


def _classes() -> dict[str, str]:
    """Class name -> module of every class defined in steadyrl/."""
    out = {}
    for file in (REPO / "steadyrl").rglob("*.py"):
        module = ".".join(file.relative_to(REPO).with_suffix("").parts)
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = module
    return out


def test_every_cited_file_exists() -> None:
    cited = [t.split("::")[0] for t in TICKED if re.fullmatch(r"[\w/.-]+\.(py|md|json|yaml)(::\w+)?", t)]
    assert len(cited) > 20
    missing = [name for name in cited if "/" in name and _path(name) is None]
    assert missing == [], f"ARCHITECTURE.md cites files that do not exist: {missing}"


def test_every_cited_class_member_exists() -> None:
    classes = _classes()
    pairs = set(re.findall(r"\b([A-Z]\w+)\.([a-z_]\w*)\b", DOC))  # in backticks and in the step diagram
    checked = [(c, m) for c, m in pairs if c in classes]
    assert len(checked) >= 8
    missing = [f"{c}.{m}" for c, m in checked if not hasattr(getattr(importlib.import_module(classes[c]), c), m)]
    assert missing == [], f"ARCHITECTURE.md cites members that do not exist: {missing}"


def test_cited_tests_and_mutants_exist() -> None:
    for node_id in [t for t in TICKED if "::" in t]:
        file, name = node_id.split("::")
        assert f"def {name}(" in (REPO / file).read_text(), node_id
    mutants = (REPO / "scripts" / "mutation_check.py").read_text()
    for name in re.findall(r"mutant `(\w+)`", DOC):
        assert f'"{name}",' in mutants, name


def _code(line: str) -> str:
    return line.split("  #")[0].strip()


def test_the_worked_example_is_the_code() -> None:
    """Each python block after "`steadyrl/<file>.py`, ..." is made of that file's lines (comments aside)."""
    # a path, the rest of its paragraph, one blank line, the block
    blocks = re.findall(r"`(steadyrl/[\w/]+\.py)`[^\n]*\n(?:[^\n]+\n)*\n```python\n(.*?)```", DOC, re.S)
    assert len(blocks) == 2, "the worked example has two code blocks, each after the file it quotes"
    for file, block in blocks:
        source = {_code(line) for line in (REPO / file).read_text().splitlines()}
        lines = [_code(line) for line in block.splitlines() if line.strip() and line.strip() != "..."]
        missing = [line for line in lines if line not in source]
        assert missing == [], f"ARCHITECTURE.md's example quotes lines {file} does not have: {missing}"
