"""The public names: every ``edgespec.X`` the README and the docs use
resolves, and ``dir(edgespec)`` / ``__all__`` list the lazily imported ones."""
from __future__ import annotations

import re
from pathlib import Path

import edgespec

ROOT = Path(__file__).resolve().parent.parent


def _documented_names() -> set[str]:
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    names = set()
    for path in texts:
        names |= set(re.findall(r"\bedgespec\.([A-Z][A-Za-z0-9_]*)", path.read_text()))
    return names


def test_every_name_the_docs_use_resolves():
    names = _documented_names()
    assert {"Engine", "EdgespecError"} <= names   # the scan finds the names it should
    missing = sorted(n for n in names if not hasattr(edgespec, n))
    assert not missing, f"the docs name edgespec.{missing} but the package has no such name"


def test_every_exported_name_resolves_and_is_listed():
    assert {"Engine", "EngineConfig", "EngineBusyError", "EngineClosedError"} <= set(edgespec.__all__)
    for name in edgespec.__all__:
        assert getattr(edgespec, name) is not None, name
    assert set(edgespec.__all__) <= set(dir(edgespec))


def test_the_errors_the_engine_raises_are_the_exported_ones():
    from edgespec import errors

    assert edgespec.EngineBusyError is errors.EngineBusyError
    assert issubclass(edgespec.EngineClosedError, edgespec.EdgespecError)
    public = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)
              and v.__module__ == errors.__name__ and not n.startswith("Native")}
    assert public <= set(edgespec.__all__), sorted(public - set(edgespec.__all__))
