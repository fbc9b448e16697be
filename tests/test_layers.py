"""The package's layers, read from its import statements (ARCHITECTURE.md explains them).

Each deltalang module belongs to one layer and imports only modules of its own
layer or below; the language and compiler (layers 3-4) and the value layer
(layer 5) never import each other; and no deltalang module imports another
inside a function, except the entry points (`cli`, `notebook`, the package face), which
import lazily so that commands start fast. A module this test does not know
fails it: a new module gets a layer here and a line in ARCHITECTURE.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "deltalang"

# module (dotted, relative to deltalang; a package covers its modules) -> layer
LAYERS: dict[str, int] = {
    "errors": 1, "values": 1, "families": 1, "measures": 1, "bundled": 1, "testing": 1, "testing_ssd": 1, "version": 1,
    "datasets": 1, "lexer": 1, "html": 1, "display": 1, "compat": 1, "internals": 1, "quiet": 1, "shard_file": 1, "allocator": 1,
    "spec": 2, "tokens": 2,
    "ast": 3, "parse": 3, "ir": 3, "resolve": 3, "check": 3,
    "plan": 4, "batches": 4, "directions": 4, "emit": 4, "explain": 4, "shown": 4,
    "backends": 5, "deltarule": 5, "ssd": 5, "kernels": 5, "mixer": 5, "info": 5, "model": 5, "gradients": 5,
    "results": 6, "compiled": 6,
    "sweep": 7, "dataset_run": 7, "dataset_generate": 7, "dataset_store": 7, "collect": 7, "collection": 7, "shards": 7, "merge": 7,
    "run": 8, "cli": 8, "options": 8, "notebook": 8, "__init__": 8, "__main__": 8,
}
# layers that never import each other: the language and compiler, and the value layer
APART = ({3, 4}, {5})
ENTRY_POINTS = {"cli", "options", "notebook", "__init__", "__main__"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _layer(dotted: str) -> int | None:
    head = dotted.split(".")[0]
    return LAYERS.get(head)


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported deltalang module, line, inside a function) for every import of deltalang in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = _dotted(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    if package == ["__init__"]:
        package = []
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)] if child.level > 1 else package
                    target = ".".join([*base, *(child.module.split(".") if child.module else [])])
                    names = [target] if child.module else [f"{target}.{a.name}".strip(".") for a in child.names]
                elif child.module and child.module.split(".")[0] == "deltalang":
                    target = child.module.split(".", 1)[1] if "." in child.module else ""
                    names = [target] if target else [a.name for a in child.names]
                else:
                    names = []
                for name in names:
                    if name:
                        out.append((name, child.lineno, inside))
            elif isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == "deltalang" and "." in a.name:
                        out.append((a.name.split(".", 1)[1], child.lineno, inside))
            visit(child, inside)

    visit(tree, False)
    return out


MODULES = _modules()


def test_every_module_has_a_layer() -> None:
    unknown = [_dotted(p) for p in MODULES if _layer(_dotted(p)) is None]
    assert not unknown, f"modules without a layer (add them to LAYERS and ARCHITECTURE.md): {unknown}"


@pytest.mark.parametrize("path", MODULES, ids=[_dotted(p) for p in MODULES])
def test_imports_go_down(path: Path) -> None:
    me = _dotted(path)
    mine = _layer(me)
    assert mine is not None
    wrong = []
    for name, line, inside in _imports(path):
        theirs = _layer(name)
        if theirs is None:
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{line}: {me} (layer {mine}) imports {name} (layer {theirs})"
        if theirs > mine:
            wrong.append(where + ": upward")
        if any(mine in group for group in APART) and any(theirs in group for group in APART):
            if next(g for g in APART if mine in g) is not next(g for g in APART if theirs in g):
                wrong.append(where + ": the language/compiler and the value layer never import each other")
        if inside and me.split(".")[0] not in ENTRY_POINTS:
            wrong.append(where + ": inside a function (only the entry points import lazily)")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_imports() -> None:
    """The test reads what it claims to: known imports of known modules are found."""
    found = {name for name, _, _ in _imports(PACKAGE / "cli.py")}
    assert "errors" in found
    parse = {name for name, _, _ in _imports(PACKAGE / "parse.py")}
    assert {"ast", "errors"} <= parse


# the parser and the AST are long lists of small rules; every other module stays readable at one sitting
LONG_MODULES = {"parse", "ast"}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


@pytest.mark.parametrize("path", MODULES, ids=[_dotted(p) for p in MODULES])
def test_modules_and_functions_stay_short(path: Path) -> None:
    me = _dotted(path)
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    if me not in LONG_MODULES:
        assert lines <= MAX_MODULE_LINES, f"{me}: {lines} lines (at most {MAX_MODULE_LINES})"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{me}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"
