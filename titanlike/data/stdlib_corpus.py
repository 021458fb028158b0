"""The embedded default corpus: the Python standard library's own `*.py` sources, read at run time.

It is on every machine that can run titanlike, needs no network, and is real (if narrow) text: enough to train a
tiny model whose loss visibly falls. The file list is sorted, so every process sees the same documents in the same
order, and its fingerprint (relative paths + sizes) keys everything cached from it.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# First-run cost is tokenising this much text (~3 s per 10 MB on 2 cores); the whole non-test stdlib is ~12 MB,
# which is ~4M tokens at the builtin vocabulary: ample for the debug model.
STDLIB_CORPUS_MAX_BYTES = 20_000_000

# Installed packages are not the stdlib and vary per machine; test suites are huge, odd (encoding torture tests) and
# optional in distro packages, so they would make the corpus differ between otherwise equal machines.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class CorpusFiles:
    root: Path
    files: tuple[str, ...]  # POSIX paths relative to root, sorted
    total_bytes: int
    fingerprint: str  # sha256 over (relative path, size) of every file, in order

    def paths(self) -> Iterator[Path]:
        return (self.root / f for f in self.files)


def stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        raise FileNotFoundError(
            f"the Python standard library sources were not found at {root} (this interpreter ships without them?). "
            "Use --data.dataset=mock, or point the data config at another dataset."
        )
    return root


def list_stdlib_files(max_bytes: int | None = STDLIB_CORPUS_MAX_BYTES, root: Path | None = None) -> CorpusFiles:
    """Sorted `*.py` files under the stdlib, taken in order until `max_bytes` (file sizes) is reached; None = all.

    Capping by on-disk size rather than decoded characters lets the fingerprint be computed from `stat` alone, so a
    cache hit never reads the corpus.
    """
    root = Path(root) if root is not None else stdlib_root()
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked folders: no cycles
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    found.sort()

    digest = hashlib.sha256()
    chosen: list[str] = []
    total = 0
    for rel in found:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            size = (root / rel).stat().st_size
        except OSError:  # dangling symlink and the like
            continue
        chosen.append(rel)
        total += size
        digest.update(f"{rel}\t{size}\n".encode())
    if not chosen:
        raise FileNotFoundError(f"no *.py files found under {root}; use --data.dataset=mock")
    return CorpusFiles(root=root, files=tuple(chosen), total_bytes=total, fingerprint=digest.hexdigest())


def read_texts(corpus: CorpusFiles) -> Iterator[str]:
    """Each file's text, in order; files that are not valid UTF-8 (a few codec tests in some distros) are skipped."""
    for path in corpus.paths():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            yield text
