"""The docs against the code and the results: the code cites documents in the repository only, and every
docs/DESIGN.md section it names exists; every results file the docs link traces to a command and a clean commit, and
none is left unlinked; every default the docs state is the dataclass's default."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

import steadyrl
from steadyrl.config.guard_sections import GuardsSection
from steadyrl.config.sections import (
    DataSection,
    EvalSection,
    ModelSection,
    PeftSection,
    PPOSection,
    PreemptionSection,
    RewardSection,
)

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


# -- numbers that trace: every results file a doc links exists, names its command and a clean commit -----------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "docs" / "results"
RESULT_LINK = re.compile(r"results/([\w.-]+\.json)")
CLEAN_COMMIT = re.compile(r"[0-9a-f]{7,40}")  # a committed tree: no "-dirty" / "+dirty", no prose


def _commits(node: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every value stored under a key named ``commit``, with where it sits (cells and their metrics included)."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "commit":
                found += [(f"{path}.commit", v) for v in (value if isinstance(value, list) else [value])]
            else:
                found += _commits(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _commits(value, f"{path}[{i}]")
    return found


def results_problems(doc: dict[str, Any]) -> list[str]:
    """What keeps a results file from tracing: no command, or a commit that is not a clean tree's hash.

    A merge of runs from several commits may say ``"per cell"`` at the top when every cell records its own command
    and clean commit (the merge is the script's, and each number still names the tree it came from)."""
    problems = []
    if not (isinstance(doc.get("command"), str) and doc["command"].strip()):
        problems.append("no command")
    cells = doc.get("cells") if isinstance(doc.get("cells"), list) else []
    top = doc.get("commit")
    per_cell = bool(cells) and all(isinstance(c, dict) and "commit" in c for c in cells)
    if not (isinstance(top, str) and (CLEAN_COMMIT.fullmatch(top) or (top == "per cell" and per_cell))):
        problems.append(f"commit {top!r} is not 7-40 hex digits of a clean tree")
    if top == "per cell" and per_cell:
        problems += [f"cell {i} has no command" for i, c in enumerate(cells) if not str(c.get("command", "")).strip()]
    joined = {f".cells[{i}].commit" for i, c in enumerate(cells) if isinstance(c, dict) and c.get("runs")}
    problems += [
        f"{where} = {value!r} is not a clean commit"
        for where, value in _commits(doc)
        if where != ".commit"
        and not (isinstance(value, str) and CLEAN_COMMIT.fullmatch(value))
        and not (where in joined and value == "per run")  # a cell joined seed by seed: each run names its commit
    ]
    return problems


def _linked_results() -> dict[str, list[str]]:
    """results file name -> the docs that mention it (README.md and docs/*.md)."""
    linked: dict[str, list[str]] = {}
    for path in DOCS:
        for name in RESULT_LINK.findall(path.read_text()):
            linked.setdefault(name, []).append(path.name)
    return linked


def test_linked_results_files_exist_and_trace() -> None:
    linked = _linked_results()
    assert linked, "no doc links a results file"
    problems = []
    for name, docs in sorted(linked.items()):
        path = RESULTS / name
        if not path.is_file():
            problems.append(f"{name} (linked from {sorted(set(docs))}): no such file")
            continue
        problems += [f"{name}: {p}" for p in results_problems(json.loads(path.read_text()))]
    assert problems == []


def test_every_results_file_is_linked_from_a_doc() -> None:
    linked = set(_linked_results())
    stored = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())
    assert [name for name in stored if name not in linked] == []


# -- the docs state the code's defaults ------------------------------------------------------------------------------
# A stated default is written one way: inline code `dotted.key: value` (a setting is written `dotted.key=value`), or a
# table row under a header with a "key" and a "default" column, each cell in inline code.

SECTIONS: dict[str, type] = {
    "guards": GuardsSection,
    "model": ModelSection,
    "data": DataSection,
    "rewards[]": RewardSection,
    "peft": PeftSection,
    "eval": EvalSection,
    "ppo": PPOSection,
    "preemption": PreemptionSection,
}
_ROOTS = "|".join(re.escape(r) for r in SECTIONS)
INLINE_DEFAULT = re.compile(rf"^((?:{_ROOTS})\.[\w.]+):\s+(.+)$")
KEY_CELL = re.compile(rf"^`((?:{_ROOTS})\.[\w.]+)`$")
CODE = re.compile(r"`([^`\n]+)`")


def dataclass_default(key: str) -> Any:
    """The default of a dotted config key (``guards.quatro.entropy.pg_brake``), walking the section dataclasses."""
    root = next(r for r in sorted(SECTIONS, key=len, reverse=True) if key.startswith(r + "."))
    cls: Any = SECTIONS[root]
    parts = key[len(root) + 1 :].split(".")
    for i, name in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if name not in fields:
            raise KeyError(f"{key}: no field {name!r}")
        spec = fields[name]
        if spec.default is not dataclasses.MISSING:
            value = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            value = spec.default_factory()
        else:
            raise KeyError(f"{key}: required, it has no default")
        if i == len(parts) - 1:
            return value
        cls = type(value)
    raise KeyError(key)


def stated_defaults(text: str) -> list[tuple[int, str, str]]:
    """(line, key, value text) of every default the text states, fenced code blocks left out."""
    lines = text.splitlines()
    fenced, found = False, []
    header: list[str] | None = None
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        found += [(number, m[1], m[2].strip()) for span in CODE.findall(line) if (m := INLINE_DEFAULT.match(span))]
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            header = None
        elif header is None:
            header = [c.lower() for c in cells]
        elif "key" in header and "default" in header and len(cells) == len(header):
            key, value = cells[header.index("key")], CODE.findall(cells[header.index("default")])
            if (m := KEY_CELL.match(key)) and value:
                found.append((number, m[1], value[0]))
    return found


def _same(stated: Any, actual: Any) -> bool:
    if isinstance(actual, bool) or actual is None or isinstance(stated, bool):
        return stated is actual or (stated == actual and type(stated) is type(actual))
    if isinstance(actual, (int, float)):
        try:
            return math.isclose(float(stated), float(actual), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    if isinstance(actual, (list, tuple)):
        return isinstance(stated, list) and len(stated) == len(actual) and all(map(_same, stated, actual))
    return stated == actual


def default_problems(text: str, name: str) -> list[str]:
    problems = []
    for number, key, value in stated_defaults(text):
        try:
            actual = dataclass_default(key)
        except KeyError as exc:
            problems.append(f"{name}:{number}: {exc.args[0]}")
            continue
        if not _same(yaml.safe_load(value), actual):
            problems.append(f"{name}:{number}: states {key}: {value}, the code's default is {actual!r}")
    return problems


def test_stated_defaults_match_the_dataclasses() -> None:
    counts = {p.name: len(stated_defaults(p.read_text())) for p in DOCS}
    assert counts["README.md"] >= 20 and counts["DESIGN.md"] >= 40, counts  # the docs do state them this way
    assert [p for path in DOCS for p in default_problems(path.read_text(), path.name)] == []


def test_the_checks_catch_a_wrong_default_and_an_untraced_results_file() -> None:
    text = (
        "`guards.quatro.entropy.pg_brake: 0.0` and `guards.gepo.spike.min_ratio: 100.0`\n\n"
        "| key | default |\n|---|---|\n| `guards.quatro.entropy.brake_moments` | `0` |\n| `guards.nope.x` | `1` |\n"
        "```yaml\nguards.quatro.entropy.pg_brake: 0.5\n```\n`guards.quatro.entropy.pg_brake=0` is a setting\n"
    )
    assert default_problems(text, "t") == [
        "t:1: states guards.quatro.entropy.pg_brake: 0.0, the code's default is 1.0",
        "t:5: states guards.quatro.entropy.brake_moments: 0, the code's default is 0.01",
        "t:6: guards.nope.x: no field 'nope'",
    ]
    clean = {"command": "python scripts/x.py", "commit": "0e28276", "cells": [{"metrics": {"commit": ["a6713b6"]}}]}
    assert results_problems(clean) == []
    assert results_problems({**clean, "commit": "e0ac5de3849a94d4ea58700d4f3f10e71dbe5d95-dirty"}) != []
    assert results_problems({**clean, "command": ""}) == ["no command"]
    spliced = {**clean, "cells": [{"metrics": {"commit": ["4e0ff008613acfa0d990d54ec515d10cab720dde+dirty"]}}]}
    assert results_problems(spliced) == [
        ".cells[0].metrics.commit = '4e0ff008613acfa0d990d54ec515d10cab720dde+dirty' is not a clean commit"
    ]
    joined = {"command": "per cell", "commit": "per cell", "cells": [{"command": "a ; b", "commit": "per run",
              "runs": [{"seeds": [0], "commit": "0e28276"}, {"seeds": [1], "commit": "a6713b6-dirty"}]}]}  # fmt: skip
    assert results_problems(joined) == [".cells[0].runs[1].commit = 'a6713b6-dirty' is not a clean commit"]
    assert results_problems({**joined, "cells": [{"command": "a", "commit": "per run"}]}) == [
        ".cells[0].commit = 'per run' is not a clean commit"  # "per run" only where the cell lists its runs
    ]


def test_readme_carries_the_two_commands_ci_and_users_run() -> None:
    """CI runs the test command README.md gives users (.ci/run); both setup-to-result commands stay verbatim."""
    readme = (ROOT / "README.md").read_text()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("bash scripts/setup.sh")]
    assert ci == ["bash scripts/setup.sh dev && bash scripts/test.sh"]
    for command in (*ci, "bash scripts/setup.sh dev && bash scripts/demo.sh"):
        assert f"```bash\n{command}\n```" in readme
