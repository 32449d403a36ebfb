"""What a run was computed with: the versions of the packages that decide its numbers, and steadyrl's commit.

Every training run writes it to ``OUTPUT_DIR/environment.json`` next to ``resolved_config.yaml``, and every
benchmark script puts it in its ``docs/results/*.json`` (key ``packages``). An upstream release can change a result
while steadyrl's code stays the same (the tiny SFT checkpoint's exact match went from 0.39 on 2026-12-01 to 0.54 on
2026-12-02 from the same command and commit), so a figure is reproducible only with the versions it came from.
It also records the machine, because the versions alone do not pin a number: with the very package versions
recorded for the 0.54, the same SFT gave 0.385 twice on an Intel Xeon and 0.540 on an AMD EPYC (2026-12-02, torch's
CPU kernels AVX512 on both; the GRPO runs from the 0.54 checkpoint then matched the stored ones run for run). The
CPU vendor, not only its instruction set, moves float results (the math libraries dispatch different kernels); and
on one vendor the instruction set does too: an AMD EPYC whose torch picked AVX2 kernels gave 0.550 (2026-12-02).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

PACKAGES = (
    "steadyrl",
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "peft",
    "datasets",
    "tokenizers",
    "safetensors",
    "numpy",
    "deepspeed",
    "vllm",
    "math-verify",
)
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
    """The processor, the instruction set torch's CPU kernels use (``torch.backends.cpu.get_cpu_capability``) and
    the accelerator, if any: float results, and so a run's numbers, can differ between two of them."""
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    found: dict[str, str | None] = {"cpu": cpu, "arch": platform.machine() or None, "torch_cpu_kernels": None}
    found["accelerator"] = None
    try:
        import torch

        found["torch_cpu_kernels"] = torch.backends.cpu.get_cpu_capability()
        if torch.cuda.is_available():
            found["accelerator"] = torch.cuda.get_device_name(0)
    except (ImportError, RuntimeError, AttributeError):
        pass
    return found


def machine_line() -> str:
    """``machine()`` as the one-line ``machine`` field of a benchmark's ``docs/results/*.json``: cores, CPU, torch's
    CPU kernels, accelerator and ``OMP_NUM_THREADS``."""
    found = machine()
    accelerator = found["accelerator"] or "no GPU"
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (
        f"{os.cpu_count()}-core {found['cpu'] or 'CPU'} ({found['arch']}, torch CPU kernels "
        f"{found['torch_cpu_kernels']}), {accelerator}, OMP_NUM_THREADS={threads}"
    )


def source_commit() -> str | None:
    """steadyrl's git commit, with ``+dirty`` when the tracked files differ from it; None when steadyrl does not run
    from its own checkout (an installed wheel inside some other repository reports None, not that repository's)."""
    try:
        top = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if not top or Path(top).resolve() != REPO.resolve() or not (REPO / "steadyrl" / "__init__.py").is_file():
            return None
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None


def environment() -> dict[str, object]:
    """``{"steadyrl_commit": ..., "packages": {...}, "machine": {...}}``: what ``environment.json`` holds."""
    return {"steadyrl_commit": source_commit(), "packages": package_versions(), "machine": machine()}


def write_environment(out: Path) -> None:
    """``out/environment.json``: this process's environment; when the file is already there (a resumed run) and
    says otherwise, the earlier records are kept under ``"earlier"``, oldest first, so a run that was resumed under
    other package versions says so."""
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
