"""The package's import graph: no circles, and no import from a higher layer.
The layers are the table in docs/ARCHITECTURE.md's ```layers block (the
drawing and this check read the same lines); every import statement counts,
those inside functions too."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "edgespec"


def layers() -> dict[str, int]:
    """Module prefix -> layer number, from ARCHITECTURE.md (``N name: a, b``)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S).group(1)
    out = {}
    for line in block.splitlines():
        m = re.match(r"\s*(\d+)\s+[^:]+:\s*(.+)", line)
        if m:
            for prefix in m.group(2).split(","):
                out[prefix.strip()] = int(m.group(1))
    return out


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The edgespec modules ``name`` imports (any statement, any depth)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def layer_of(name: str, table: dict[str, int]) -> int:
    """The layer of the longest prefix naming ``name`` (the package itself,
    "edgespec", names only its __init__: a module missing from the table fails)."""
    prefix = max((p for p in table if name == p or (p != "edgespec" and name.startswith(p + "."))),
                 key=len, default=None)
    assert prefix is not None, f"{name} is in no layer of docs/ARCHITECTURE.md"
    return table[prefix]


def test_every_module_has_a_layer_and_imports_only_down_or_across():
    table, known = layers(), modules()
    upward = []
    for name, path in known.items():
        mine = layer_of(name, table)
        for target in imports(name, path, known):
            if layer_of(target, table) > mine:
                upward.append(f"{name} (layer {mine}) imports {target} (layer {layer_of(target, table)})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    # Tarjan's strongly connected components: any of more than one module is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: an import from a higher layer is found."""
    table = {"edgespec.low": 0, "edgespec.high": 1}
    path = tmp_path / "low.py"
    path.write_text("def f():\n    from .high import thing\n")
    known = {"edgespec.low": path, "edgespec.high": tmp_path / "high.py"}
    assert imports("edgespec.low", path, known) == {"edgespec.high"}
    assert layer_of("edgespec.high", table) > layer_of("edgespec.low", table)
