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
    "ground.errors": 1, "ground.measures": 1, "ground.version": 1, "ground.datasets": 1, "ground.html": 1,
    "ground.display": 1, "ground.compat": 1, "ground.quiet": 1, "ground.allocator": 1,
    "models.values": 1, "models.families": 1, "models.bundled": 1, "models.testing": 1, "models.testing_ssd": 1,
    "models.internals": 1, "language.lexer": 1, "runs.shard_file": 1,
    "models.spec": 2, "language.tokens": 2,
    "language.ast": 3, "language.parse": 3, "language.ir": 3, "language.resolve": 3, "language.check": 3,
    "compiler.plan": 4, "compiler.batches": 4, "compiler.directions": 4, "compiler.emit": 4, "compiler.explain": 4,
    "compiler.shown": 4,
    "runtime.backends": 5, "runtime.deltarule": 5, "runtime.ssd": 5, "runtime.kernels": 5, "runtime.mixer": 5,
    "runtime.info": 5, "runtime.model": 5, "runtime.gradients": 5,
    "runs.results": 6, "runs.compiled": 6,
    "sweep": 7, "runs.dataset_run": 7, "runs.records": 7, "runs.dataset_generate": 7, "runs.dataset_store": 7, "runs.collect": 7,
    "runs.collection": 7, "runs.shards": 7, "merge": 7,
    "run": 8, "cli": 8, "options": 8, "notebook": 8, "__init__": 8, "__main__": 8,
    "testing": 8, "testing_ssd": 8,  # the old paths of models.testing*, kept for users' imports
}
# the folders, lowest first: a module imports only from its own folder or folders before it; the package
# root holds the entry points (and the two old paths above), above every folder
FOLDERS = ["ground", "models", "language", "compiler", "runtime", "runs", "sweep"]
# the language and compiler never import the value layer's runtime, nor it them (both stand on models/)
FOLDERS_APART = ({"language", "compiler"}, {"runtime"})
# a folder's `__init__` (its docstring, its contract) sits at its folder's lowest layer
FOLDER_INITS = {f: min(v for k, v in LAYERS.items() if k.startswith(f + ".")) for f in FOLDERS if f not in LAYERS}
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
    if dotted in FOLDER_INITS:
        return FOLDER_INITS[dotted]
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def _folder(dotted: str) -> str:
    """The layer folder a module lives in; "" for the package root."""
    head = dotted.split(".")[0]
    return head if head in FOLDERS else ""


def _rank(folder: str) -> int:
    return FOLDERS.index(folder) if folder else len(FOLDERS)


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


@pytest.mark.parametrize("path", MODULES, ids=[_dotted(p) for p in MODULES])
def test_folders_import_in_order(path: Path) -> None:
    """A folder is a layer: its modules import their own folder's and earlier folders' modules only."""
    me = _dotted(path)
    mine = _folder(me)
    wrong = []
    for name, line, _ in _imports(path):
        theirs = _folder(name)
        if _layer(name) is None or theirs == mine:
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{line}: {me} ({mine or 'root'}) imports {name} ({theirs or 'root'})"
        if _rank(theirs) > _rank(mine):
            wrong.append(where + ": a later folder")
        if any(mine in g and theirs in h for g, h in (FOLDERS_APART, FOLDERS_APART[::-1])):
            wrong.append(where + ": the language/compiler and the runtime never import each other")
    assert not wrong, "\n".join(wrong)


def test_the_root_holds_only_entry_points() -> None:
    """Every module lives in a layer folder but the entry points (and the old `testing` paths)."""
    at_root = {_dotted(p) for p in MODULES if "." not in _dotted(p)} - set(FOLDERS)
    assert at_root <= ENTRY_POINTS | {"run", "merge", "testing", "testing_ssd"}, sorted(at_root)


def test_the_checker_sees_imports() -> None:
    """The test reads what it claims to: known imports of known modules are found."""
    found = {name for name, _, _ in _imports(PACKAGE / "cli.py")}
    assert "ground.errors" in found
    parse = {name for name, _, _ in _imports(PACKAGE / "language" / "parse.py")}
    assert {"language.ast", "ground.errors"} <= parse


# the parser and the AST are long lists of small rules; every other module stays readable at one sitting
LONG_MODULES = {"language.parse", "language.ast"}
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
