"""Where locally built artefacts (the builtin tokenizer, tokenised corpora) live, and how they are written.

Every cached file is built at most once per machine at a time and appears atomically: the builder writes a private
temporary file and `os.replace`s it into place, so a reader (another rank, another run) sees either nothing or the
whole file, never a half-written one. A per-file advisory lock makes concurrent ranks wait for the first builder
instead of all burning CPU on the same job; where locks are unavailable (no fcntl, odd file systems) every process
simply builds its own copy and the atomic replace still keeps readers safe.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Callable, Iterator

try:  # POSIX only; the lock is an optimisation, not what makes the cache safe
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

ENV_CACHE = "TITANLIKE_CACHE"
DEFAULT_CACHE = "~/.cache/titanlike"


def cache_root(cache_dir: str = "") -> Path:
    """The cache folder: an explicit `data.cache_dir`, else $TITANLIKE_CACHE, else ~/.cache/titanlike."""
    chosen = cache_dir or os.environ.get(ENV_CACHE, "") or DEFAULT_CACHE
    return Path(os.path.expandvars(chosen)).expanduser()


def is_rank0() -> bool:
    """True unless a launcher (torchrun, slurm) says this process is another rank; used to keep progress bars quiet."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "0") != "0":
            return False
    return True


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # read-only or lock-less location: fall back to "everyone builds"
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel even if the holder dies
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def build_once(path: Path, build: Callable[[Path], None]) -> Path:
    """Return `path`, first calling `build(tmp_path)` and atomically moving the result there if it is missing."""
    path = Path(path)
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(
            f"cannot create the titanlike cache folder {path.parent}: {e}. "
            f"Point --data.cache_dir (or ${ENV_CACHE}) at a writable folder."
        ) from e
    with _file_lock(path.with_name(path.name + ".lock")):
        if path.exists():  # built by another process while we waited for the lock
            return path
        # Same folder as the target so os.replace is a rename on one file system; pid+uuid keeps builders apart.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            build(tmp)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    return path
