"""Checkpoint integrity: the size and SHA-256 hash of every file, recorded in the completion marker (``"files"`` of
``steadyrl_complete.json``, by ``checkpoints.publish_checkpoint``), checked on resume: ``verify`` names the first file
missing, of another size (checked for all files before any hash) or another hash. Files are hashed in threads
(SHA-256: faster than BLAKE2b on CPUs with SHA extensions). A marker without ``"files"`` (older) is trusted.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HASH = "sha256"


def file_hash(path: Path, fsync: bool = False) -> str:
    """SHA-256 hex digest of a file, read in 1 MiB chunks; ``fsync`` also flushes it to disk."""
    digest = hashlib.new(HASH)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _workers(count: int) -> int:
    return max(1, min(8, os.cpu_count() or 1, count))


def manifest(folder: Path, exclude: frozenset[str] = frozenset(), fsync: bool = False) -> dict[str, dict[str, object]]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` for every file under ``folder`` but ``exclude``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in exclude)
    with ThreadPoolExecutor(_workers(len(files))) as pool:
        digests = list(pool.map(lambda p: file_hash(p, fsync), files))
    pairs = zip(files, digests, strict=True)
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, HASH: digest} for p, digest in pairs}


def verify(folder: Path, files: dict[str, dict[str, object]]) -> str | None:
    """None when every recorded file is there with its size and hash; else what is wrong, naming the file."""
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{path} has {size} bytes, the completion marker recorded {meta['size']} (truncated or overwritten)"
    names = list(files)
    with ThreadPoolExecutor(_workers(len(names))) as pool:
        digests = list(pool.map(lambda n: file_hash(folder / n), names))
    for name, digest in zip(names, digests, strict=True):
        if digest != files[name][HASH]:
            return f"{folder / name} does not match the {HASH} hash in the completion marker (its bytes changed)"
    return None
