"""The package's import graph: no circles, and no import from a higher layer.
The layers are the table in docs/ARCHITECTURE.md's ```layers block (the
drawing and this check read the same lines); every import statement counts,
those inside functions too. The C core's files likewise form no circle of
symbol uses (a file that uses another's es_ function or table depends on it)."""
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


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def reached_privates(name: str, path: Path, known: dict) -> list[str]:
    """Where ``name`` takes another package module's ``_private`` name: ``from
    m import _x``, or ``m._x`` on a name bound to an imported package module
    (``self._x``, ``cls._x`` and the module's own names are its own)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    bound = {}   # local name -> the package module it names
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    bound[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base not in known:
                continue
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                elif private(a.name) and base != name:
                    found.append(f"{name}:{node.lineno} imports {base}.{a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                and bound.get(node.value.id, name) != name):
            found.append(f"{name}:{node.lineno} reaches {bound[node.value.id]}.{node.attr}")
    return found


def test_no_module_reaches_another_modules_privates():
    """A module's ``_names`` are its own: other modules use public names or seams."""
    known = modules()
    found = [hit for name, path in known.items() for hit in reached_privates(name, path, known)]
    assert not found, "\n".join(sorted(found))


def test_the_check_sees_a_reached_private(tmp_path):
    """The checker itself: an imported private and a module's private reached
    through its name are found; a private of one's own, of ``self`` or of a
    module outside the package are not."""
    path = tmp_path / "user.py"
    path.write_text("import json\nfrom . import low\nfrom .low import _hidden, shown\n"
                    "_mine = 1\n\nclass A:\n    def f(self):\n"
                    "        return low._secret, self._x, _mine, json._default_decoder, shown\n")
    known = {"edgespec": tmp_path / "__init__.py", "edgespec.user": path, "edgespec.low": tmp_path / "low.py"}
    assert reached_privates("edgespec.user", path, known) == [
        "edgespec.user:3 imports edgespec.low._hidden", "edgespec.user:8 reaches edgespec.low._secret"]


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


def circles(graph: dict) -> list[list]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

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
                found.append(sorted(map(str, component)))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    known = modules()
    assert not circles({name: imports(name, path, known) for name, path in known.items()})


def c_uses(sources: dict[str, str]) -> dict[str, set[str]]:
    """File -> the files whose non-static es_ symbols (functions, tables) it uses."""
    strip = lambda t: re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", t, flags=re.S))
    texts = {name: strip(text) for name, text in sources.items()}
    owner = {}
    for name, text in texts.items():
        for m in re.finditer(r"^(?!static\b)[A-Za-z_][\w \*]*?\b(es_\w+)\s*[(\[=;]", text, re.M):
            owner.setdefault(m.group(1), name)
    return {name: {owner[s] for s in set(re.findall(r"\b(es_\w+)\b", text)) if owner.get(s, name) != name}
            for name, text in texts.items()}


def test_no_circles_between_the_c_files():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "csrc").rglob("*.c")
               if not {"tests", "fuzz"} & set(p.relative_to(ROOT).parts)}
    assert "csrc/native/model.c" in sources and "csrc/native/moe.c" in sources
    assert not circles(c_uses(sources))


def test_the_c_check_sees_a_circle():
    sources = {"a.c": "int es_a(void) { return es_b(); }\n",
               "b.c": "int es_b(void) { return 1; }\nint es_c(void) { return es_a(); }\n",
               "c.c": "static int es_local(void) { return 0; }\nint es_d(void) { return es_b(); }\n"}
    uses = c_uses(sources)
    assert uses == {"a.c": {"b.c"}, "b.c": {"a.c"}, "c.c": {"b.c"}}
    assert circles(uses) == [["a.c", "b.c"]]


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: an import from a higher layer is found."""
    table = {"edgespec.low": 0, "edgespec.high": 1}
    path = tmp_path / "low.py"
    path.write_text("def f():\n    from .high import thing\n")
    known = {"edgespec.low": path, "edgespec.high": tmp_path / "high.py"}
    assert imports("edgespec.low", path, known) == {"edgespec.high"}
    assert layer_of("edgespec.high", table) > layer_of("edgespec.low", table)
