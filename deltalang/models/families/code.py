"""Reading a transformers modeling file's syntax tree (nothing imported): what `families.analyse` needs.

- `hub_names(tree)`: hub-kernel name -> the module function wrapped under it (its
  decorator, `internals.HUB_DECORATOR`);
- `mixer_class(tree, kernel)`: the class whose `forward` calls `kernel` (or a module function that does);
- `mixer_paths(tree, mixer)`: the attribute paths blocks hold a mixer under, a block's own attribute first
  (`self.mamba = Mixer(...)`), then one level down (zamba2's hybrid block: `self.mamba_decoder = mamba`,
  a parameter annotated with the class holding the mixer): `("mamba", "mamba_decoder.mamba")`;
- `block_output(tree)`: what the decoder's blocks return, from the call in the model's `forward` loop over
  `self.layers` (`hidden_states = layer(...)`: a tensor; `h, w = layer(...)` or `out[0]`: a tuple), where
  annotations lie (granitemoehybrid's `-> tuple` returning a tensor); None where no such call is found;
- `returns_tuple(tree, cls)`: whether class `cls`'s `forward` is annotated `-> tuple[...]` (the fallback);
- `model_types(config_path)`: every `model_type = "..."` of a configuration file.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .. import internals


def name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def calls(node: ast.AST) -> set[str]:
    return {name(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}


def _classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [n for n in tree.body if isinstance(n, ast.ClassDef)]


def _method(cls: ast.ClassDef, method: str) -> ast.FunctionDef | None:
    return next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == method), None)


def hub_names(tree: ast.Module) -> dict[str, str]:
    """hub-kernel name -> the module-level function transformers wraps under it."""
    out: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and name(dec.func) == internals.HUB_DECORATOR
                    and dec.args and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                out[dec.args[0].value] = node.name
    return out


def reaching(tree: ast.Module, kernel: str) -> set[str]:
    """`kernel` and every module-level function that calls it, directly or through another such function
    (transformers 5.25 calls its scan through `mamba2_scan_forward`, its conv through `causal_conv1d_forward`)."""
    functions = {n.name: calls(n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    found = {kernel}
    while True:
        more = {f for f, called in functions.items() if f not in found and called & found}
        if not more:
            return found
        found |= more


def mixer_class(tree: ast.Module, kernel: str) -> str | None:
    """The class whose `forward` calls `kernel`, or a module-level function that does (`reaching`)."""
    names = reaching(tree, kernel)
    for cls in _classes(tree):
        forward = _method(cls, "forward")
        if forward is not None and names & calls(forward):
            return cls.name
    return None


def _self_assigns(cls: ast.ClassDef) -> list[tuple[str, ast.expr]]:
    """(attribute, value) of every `self.X = value` in the class's `__init__`."""
    init = _method(cls, "__init__")
    out = []
    for stmt in ast.walk(init) if init is not None else ():
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
                and name(stmt.targets[0].value) == "self"):
            out.append((stmt.targets[0].attr, stmt.value))
    return out


def _annotations(cls: ast.ClassDef) -> dict[str, str]:
    """`__init__`'s parameter -> the class name it is annotated with."""
    init = _method(cls, "__init__")
    if init is None:
        return {}
    return {a.arg: name(a.annotation) for a in init.args.args + init.args.kwonlyargs if a.annotation is not None}


def holders(tree: ast.Module, mixer: str) -> dict[str, str]:
    """class -> the attribute its `__init__` assigns a `mixer` instance to (`self.linear_attn = Mixer(...)`)."""
    out: dict[str, str] = {}
    for cls in _classes(tree):
        for attr, value in _self_assigns(cls):
            if mixer in calls(value):
                out.setdefault(cls.name, attr)
    return out


def mixer_paths(tree: ast.Module, mixer: str) -> tuple[str, ...]:
    """Every attribute path a block holds a `mixer` under: a holder's own, then a holder held one level down."""
    direct = holders(tree, mixer)
    paths = list(dict.fromkeys(direct.values()))
    for cls in _classes(tree):
        params = _annotations(cls)
        for attr, value in _self_assigns(cls):
            if isinstance(value, ast.Name):  # a parameter annotated with a holder class
                held = params.get(value.id)
            else:  # a holder built in place (not a list of them: the model's `self.layers`)
                held = name(value.func) if isinstance(value, ast.Call) else None
            if held in direct and cls.name not in direct:
                paths.append(f"{attr}.{direct[held]}")
    return tuple(dict.fromkeys(paths))


def returns_tuple(tree: ast.Module, cls_name: str) -> bool:
    """Whether class `cls_name`'s `forward` is annotated `-> tuple[...]`."""
    for cls in _classes(tree):
        forward = _method(cls, "forward") if cls.name == cls_name else None
        returns = forward.returns if forward is not None else None
        if isinstance(returns, ast.Subscript) and name(returns.value) == "tuple":
            return True
    return False


def _loop_block(loop: ast.For) -> str | None:
    """The block variable of `for layer in self.layers` (or `enumerate(self.layers[:n])`), else None."""
    over = loop.iter
    if isinstance(over, ast.Call) and name(over.func) == "enumerate" and over.args:
        over = over.args[0]
        target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) and loop.target.elts else None
    else:
        target = loop.target
    if isinstance(over, ast.Subscript):
        over = over.value
    if not (isinstance(over, ast.Attribute) and over.attr == "layers" and name(over.value) == "self"):
        return None
    return target.id if isinstance(target, ast.Name) else None


def block_output(tree: ast.Module) -> str | None:
    """"tensor" or "tuple": what the blocks return, as the model's forward takes it (None: no such loop found)."""
    for cls in _classes(tree):
        forward = _method(cls, "forward")
        for loop in ast.walk(forward) if forward is not None else ():
            block = _loop_block(loop) if isinstance(loop, ast.For) else None
            if block is None:
                continue
            for stmt in ast.walk(loop):
                if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                        and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == block):
                    continue
                target = stmt.targets[0]
                if isinstance(target, ast.Tuple):
                    return "tuple"
                return "tuple" if any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Subscript)  # x = out[0]
                                      and name(n.value.value) == name(target) for n in ast.walk(loop)) else "tensor"
    return None


def model_types(config_path: Path) -> tuple[str, ...]:
    """Every `model_type = "..."` of a configuration file's classes (the composite's and its text config's)."""
    if not config_path.exists():
        return ()
    out = []
    for node in ast.walk(ast.parse(config_path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                    target: ast.AST = stmt.targets[0]
                elif isinstance(stmt, ast.AnnAssign):
                    target = stmt.target
                else:
                    continue
                value = stmt.value
                if name(target) == "model_type" and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    out.append(value.value)
    return tuple(dict.fromkeys(out))
