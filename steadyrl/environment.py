"""What a run was computed with: the versions of the packages that decide its numbers, steadyrl's commit and the
machine (``OUTPUT_DIR/environment.json``; ``packages`` and ``machine`` in every ``docs/results/*.json``).
An upstream release or another CPU changes results while steadyrl's code stays the same.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

PACKAGES = ("steadyrl", "torch", "transformers", "trl", "accelerate", "peft", "datasets", "tokenizers", "safetensors",
            "numpy", "deepspeed", "vllm", "math-verify")  # fmt: skip
REPO = Path(__file__).resolve().parents[1]


def package_versions() -> dict[str, str | None]:
    """``{distribution: version}`` for the packages in ``PACKAGES`` (None: not installed), plus python."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def machine() -> dict[str, str | None]:
    """The processor, the instruction set torch's CPU kernels use and the accelerator, if any."""
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
    except OSError:
        names = []
    cpu = names[0] if names else platform.processor() or None
    found: dict[str, str | None] = {"cpu": cpu, "arch": platform.machine() or None, "torch_cpu_kernels": None,
                                    "accelerator": None}  # fmt: skip
    try:
        import torch

        found["torch_cpu_kernels"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            found["accelerator"] = torch.cuda.get_device_name(0)
    except (ImportError, RuntimeError, AttributeError):
        pass
    return found


def machine_line() -> str:
    """``machine()`` and ``OMP_NUM_THREADS`` as the one-line ``machine`` field of a ``docs/results/*.json``."""
    found = machine()
    return (f"{os.cpu_count()}-core {found['cpu'] or 'CPU'} ({found['arch']}, torch CPU kernels "
            f"{found['torch_cpu_kernels']}), {found['accelerator'] or 'no GPU'}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")  # fmt: skip


def source_commit() -> str | None:
    """steadyrl's git commit, with ``+dirty`` when the tracked files differ from it; None when steadyrl does not run
    from its own checkout (an installed wheel inside some other repository reports None, not that repository's)."""

    def git(*args: str, check: bool = True) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10,
                              check=check).stdout.strip()  # fmt: skip

    try:
        top = git("rev-parse", "--show-toplevel", check=False)
        if not top or Path(top).resolve() != REPO.resolve() or not (REPO / "steadyrl" / "__init__.py").is_file():
            return None
        sha = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None


def environment() -> dict[str, object]:
    """``{"steadyrl_commit": ..., "packages": {...}, "machine": {...}}``: what ``environment.json`` holds."""
    return {"steadyrl_commit": source_commit(), "packages": package_versions(), "machine": machine()}


def write_environment(out: Path) -> None:
    """``out/environment.json``; a different record already there (a resumed run) is kept under ``"earlier"``, oldest
    first."""
    path = out / "environment.json"
    record: dict[str, Any] = environment()
    earlier: list[Any] = []
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None  # a damaged file from a killed run: replaced
        if isinstance(old, dict):
            earlier = list(old.pop("earlier", []))
            if old != record:
                earlier.append(old)
    if earlier:
        record["earlier"] = earlier
    path.write_text(json.dumps(record, indent=1) + "\n")
