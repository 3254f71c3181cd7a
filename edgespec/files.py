"""Files written whole or not at all, and file digests: one place for both.

    with atomic_output(path) as tmp:      # a writer that wants a path: GGUF, a C save, a quantizer
        writer.write(tmp)
    write_atomic(path, data)              # bytes in hand

Either way the file appears complete at ``path`` or not at all: a temporary
file beside it, fsync, rename. ``with cache_writes(folder):`` turns what the
system refuses while the cache is written (a full disk, a read-only folder)
into one CacheError naming the file and the cause. A pull's part files (edgespec.models.registry)
and an export's folder (edgespec.onnx.export) follow their own protocols,
since they are resumed or cleaned up by name.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import CacheError


@contextmanager
def atomic_output(path: os.PathLike | str) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path``
    when the block ends without error, removed otherwise. Mode 0644
    (mkstemp's is 0600): these are ordinary readable files."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def cache_writes(folder: os.PathLike | str) -> Iterator[None]:
    """Writes to the cache: an OSError raised inside (ENOSPC, EROFS, EACCES)
    becomes a CacheError naming the file it names (else ``folder``) and the cause."""
    try:
        yield
    except OSError as e:
        raise CacheError(f"cannot write to {e.filename or folder}: {e.strerror or e}") from e


def write_atomic(path: os.PathLike | str, data: bytes) -> None:
    """Write ``path`` whole or not at all (see atomic_output)."""
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)


def sha256_file(path: Path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()
