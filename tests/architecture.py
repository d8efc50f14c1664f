"""The package's import graph and sizes, read from the source with `ast` (nothing is imported).

`tests/unit/test_architecture.py` holds the rules; `python tests/architecture.py` prints the report.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "thunderpool"

# Layers top to bottom (DESIGN.md §2): a module imports from its own layer or below.
LAYERS = (
    ("cli", "rank", "__main__"),  # entry points: a command, a rank process
    ("serving",),
    ("api",),
    ("bench",),
    ("cluster",),
    ("launch",),
    ("engine",),
    ("planner",),
    ("parallel",),
    ("models",),
    ("body", "config", "cores", "errors", "progress", "__init__"),
)


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted, e.g. thunderpool.engine.executor
    path: Path
    lines: int
    imports: frozenset[str]  # thunderpool modules it imports, at any depth of the file
    functions: tuple[tuple[str, int], ...]  # (qualified name, lines)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` is or lies in (`from a.b import c` may name a.b.c)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _functions(tree: ast.AST) -> list[tuple[str, int]]:
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                found.append((name, child.end_lineno - child.lineno + 1))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(tree, "")
    return found


def load() -> dict[str, Module]:
    paths = sorted((ROOT / PACKAGE).rglob("*.py"))
    known = {_module_name(p) for p in paths}
    modules = {}
    for path in paths:
        name = _module_name(path)
        source = path.read_text()
        tree = ast.parse(source)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imports = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                found = _resolve(target, known)
                if found and found != name and found != PACKAGE:
                    imports.add(found)
        # `from a import b` names both a and a.b: keep a only where b is not a module
        imports -= {
            m for m in imports if m.count(".") < 2 and any(o.startswith(m + ".") for o in imports)
        }
        modules[name] = Module(
            name, path, len(source.splitlines()), frozenset(imports), tuple(_functions(tree))
        )
    return modules


def layer(name: str) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    for rank, members in enumerate(LAYERS):
        if top in members:
            return rank
    raise KeyError(f"{name} is in no layer of tests/architecture.py LAYERS")


def upward(modules: dict[str, Module]) -> list[tuple[str, str]]:
    return sorted(
        (m.name, i) for m in modules.values() for i in m.imports if layer(i) < layer(m.name)
    )


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in modules[v].imports:
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
                found.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return found


def report() -> str:
    modules = load()
    out = [f"{len(modules)} modules, {sum(m.lines for m in modules.values())} lines"]
    found = circles(modules)
    out.append(f"\nimport circles: {len(found)}")
    out += ["  " + " <-> ".join(c) for c in found]
    up = upward(modules)
    out.append(f"\nupward imports: {len(up)}")
    out += [f"  {a} -> {b}" for a, b in up]
    big = sorted(modules.values(), key=lambda m: -m.lines)
    out.append(f"\nfiles over 400 lines: {sum(m.lines > 400 for m in big)}")
    out += [f"  {m.lines:4d} {m.name}" for m in big if m.lines > 400]
    funcs = sorted(((n, f, m.name) for m in big for f, n in m.functions), reverse=True)
    out.append(f"\nfunctions over 80 lines: {sum(n > 80 for n, _, _ in funcs)}")
    out += [f"  {n:4d} {m}.{f}" for n, f, m in funcs if n > 80]
    return "\n".join(out)


if __name__ == "__main__":
    print(report())
