"""How deltalang shows a number or a token in any table it prints: the one formatting home.

`number(x, digits)`: `digits` significant digits, never a fixed count of decimals (a norm of 4.18e-06 shows as
`4.18e-06`, not `0.0000`; `.g`: trailing zeros dropped, `1` for 1.0), never a negative zero (-0.0 or a value
that rounds to it is shown `0`); `nan` as `nan`. `signed(x)`: the same with its sign (`+1.2e-07`), for
effects and estimates. `token(text)`: a token's decoded text as every table and message shows it: a space as
`␣`, a newline as `⏎`, a tab as `⇥`, an empty piece as `?`, unquoted (`␣Paris`; never the tokenizer's spelling
'ĠParis'). Reads, statistics, sweeps, attribution, `check` and warnings all format through here; `cell(x)`, a sweep grid's, keeps its trailing zeros (a column's width then does not
hang on the last digit); stored values (CSV, JSON, safetensors) stay raw.
"""

from __future__ import annotations

import math

DIGITS = 4  # significant digits of a table's numbers
MEASURE_DIGITS = 6  # a run's measures, one per line (`deltalang run`)


def _unsigned_zero(text: str) -> str:
    """`-0` -> `0`; anything else unchanged."""
    if text.startswith("-") and float(text) == 0.0:
        return text[1:]
    return text


def number(x: float, digits: int = DIGITS) -> str:
    """`x` with `digits` significant digits (`0.0003345`, `17.72`, `4.18e-06`), no negative zero."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return _unsigned_zero(f"{x:.{digits}g}")


def cell(x: float, digits: int = DIGITS) -> str:
    """A grid cell (a sweep's table): `number`, its trailing zeros kept (`0.0001860`, `1.000`, `0.000`), so that a
    cell's width does not hang on its last digit: float32 rounding that moves it (1 thread or 2) leaves the
    columns where they were."""
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return number(x)
    return _unsigned_zero(f"{x:#.{digits}g}".rstrip("."))


def signed(x: float, digits: int = 3) -> str:
    """An effect or estimate with its sign (`-0.000412`, `+1.2e-07`); zero without one (`0`)."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    text = f"{x:+.{digits}g}"
    return text[1:] if float(text) == 0.0 else text


def token(text: str) -> str:
    """A decoded token as tables show it: `␣` for a space, `⏎` for a newline, `⇥` for a tab, `?` for an empty piece."""
    return (text or "?").replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
