"""The Python API's sweep text: `sweep(template, **axes)` builds a program with one sweep.

Contract: the returned text parses (a syntax error points at the generated line);
bad axes or templates raise DeltaSweepError. Nothing here knows a model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from deltalang.language import ast
from deltalang.language.parse import parse

from .errors import DeltaSweepError


def sweep(template: str, *, prompt: str | None = None, prompts: Mapping[str, str | Sequence[str]] | None = None,
          on: str = "clean", name: str = "grid", model: str | None = None, **axes: Any) -> str:
    """The program text of a sweep: `template` (statements) over `axes`, on `prompt`.

    Axis values: a selector or range as written (`"L[linear]"`, `"L*"`, `"0..8"`), a
    `range` of positions (step 1), or a list of ints: blocks for a variable used as a
    block (`L.state_after(t)`), a contiguous run of positions for one used as a position.
    `prompts` declares more prompts (a list declares a prompt set for `mean(...)`).
    Run the text with `deltalang.run(text)`; save it to rerun it.

        deltalang.sweep('write L.state_after(t) = zeros; measure prob(" Paris")',
                        L="L[linear]", t=range(8), prompt="The Eiffel Tower is in the city of")
    """
    if not axes:
        raise DeltaSweepError("a sweep needs at least one axis: sweep(template, L=\"L[linear]\", t=range(8), ...)")
    body = [line.strip() for line in template.strip().splitlines() if line.strip()]
    if not any(line and not line.startswith("#") for line in body):
        raise DeltaSweepError("the template has no statements")
    if any(c in template for c in "{}"):
        raise DeltaSweepError("the template is a sweep's body: statements only, without '{ }' or run headers")
    declared = dict(prompts or {})
    if prompt is not None:
        declared = {on: prompt, **{k: v for k, v in declared.items() if k != on}}
    if on not in declared:
        raise DeltaSweepError(f"the sweep runs on prompt '{on}': pass prompt=\"...\" (or prompts={{'{on}': ...}})")
    lines = ["# built by deltalang.sweep()"]
    if model is not None:
        lines.append(f"model {ast.quote(model)}")
    for pname, text in declared.items():
        if isinstance(text, str):
            lines.append(f"prompt {pname} = {ast.quote(text)}")
        else:
            lines.append(f"prompts {pname} = [{', '.join(ast.quote(t) for t in text)}]")
    over = ", ".join(f"{var} in {_axis_text(var, value, body)}" for var, value in axes.items())
    lines.append(f"sweep {name} on {on} over {over} {{")
    lines.extend(f"    {s}" for s in body)
    lines.append("}")
    text = "\n".join(lines) + "\n"
    parse(text, "<deltalang.sweep>")  # a syntax error points at the generated line
    return text


def _axis_text(var: str, value: Any, body: Sequence[str]) -> str:
    """An axis domain as the language writes it."""
    if isinstance(value, str):
        return value
    code = "\n".join(body)
    as_block = re.search(rf"(?<![\w.]){re.escape(var)}\.", code) is not None
    as_position = re.search(rf"\(\s*{re.escape(var)}\s*\)", code) is not None
    if not as_block and not as_position:
        raise DeltaSweepError(f"axis '{var}' is not used in the template as a block ({var}.state_after(...)) "
                              f"or a position (L.state_after({var}))")
    if isinstance(value, range):
        if value.step != 1 or len(value) == 0:
            raise DeltaSweepError(f"axis '{var}': a range of positions must be non-empty with step 1, got {value}")
        return f"{value.start}..{value.stop}"
    items = [value] if isinstance(value, int) else list(value)
    if not items or not all(isinstance(v, int) for v in items):
        raise DeltaSweepError(f"axis '{var}': give a selector string, a range, or a list of ints, got {value!r}")
    if as_block:
        return "L[" + ", ".join(str(v) for v in items) + "]"
    if items != list(range(items[0], items[0] + len(items))):
        raise DeltaSweepError(f"axis '{var}': positions must be contiguous (a range a..b), got {items}")
    return f"{items[0]}..{items[-1] + 1}"
