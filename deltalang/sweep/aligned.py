"""Per-token measures in a sweep over a dataset: each token named from the record's own fields, so that records of
different lengths average at the same named position.

    out = run_dataset_sweep(source, model, align="facts.subject")   # or --align facts.subject
    out.stat("s", {"L": "L4"}, "norm(L.states)", position="facts.subject + 1")

Contract: `Alignment.parse(align, ds)` takes the anchor: None or "-1" (the default: each record's end, tokens
named `-1`, `-2`, ...: the last k tokens), or a field as a dataset sweep's axis names one (`facts.subject`: the
last token of its first occurrence in the record's prompt, `facts.subject[0]`: its first token; `field_position`
says which). `anchor()` finds it in one record (a `DeltaError` where it has none: the record is left out), and
`label()` names a token of that record relative to it: `facts.subject`, `facts.subject + 2`, `facts.subject - 1`.
`order()` sorts labels by their offset, `per_token()` says whether a sweep's measure gives a number per token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs

from deltalang.ground import measures
from deltalang.ground.datasets import Dataset, Record
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.ir import Resolved, ResolvedMeasure, ResolvedRun
from deltalang.language.resolve.dataset import field_position
from deltalang.models.spec import ModelSpec
from deltalang.runs.dataset_store import format_stats

COLUMNS = ("position", "token")  # the aligned position's label, the record's own token number
_FIELD = re.compile(r"^\s*([A-Za-z_]\w*)\.([A-Za-z_]\w*)\s*(?:\[\s*(-?\d+)\s*\])?\s*$")


def per_token(m: ResolvedMeasure) -> bool:
    """Whether a sweep's measure gives a number per token: `norm(L.states)`, a reduction that keeps `s`."""
    if m.reduce is not None:
        return [a for a, _ in m.reduce.shape] == [measures.BATCH, measures.POSITIONS]
    return measures.per_token(m.kind, m.value, m.position)


@attrs.frozen
class Alignment:
    """Where a record's tokens are counted from: its end (`field` None) or a field's token."""

    field: ast.FieldPos | None = None
    anchors: dict[int, int] = attrs.field(factory=dict, eq=False)  # record -> its anchor's token number

    @staticmethod
    def parse(align: str | None, ds: Dataset) -> Alignment:
        if align is None or str(align).strip() in ("-1", "end"):
            return Alignment()
        m = _FIELD.match(str(align))
        if m is None or m.group(1) != ds.name:
            raise DeltaError(f"align= takes a field of '{ds.name}' ({ds.name}.subject, {ds.name}.subject[0]) or -1 "
                             f"(each record's end), got {align!r}")
        if m.group(2) not in ds.fields:
            raise DeltaError(f"align={align!r}: the records of '{ds.name}' have no field '{m.group(2)}' (they have "
                             f"{', '.join(ds.fields)})")
        index = None if m.group(3) is None else int(m.group(3))
        return Alignment(ast.FieldPos(ast.Field(ds.name, m.group(2)), index))

    @property
    def text(self) -> str:
        return "-1" if self.field is None else ast.format_position(self.field)

    def anchor(self, program: ast.Program, ds: Dataset, rec: Record, spec: ModelSpec) -> None:
        """Find the anchor in `rec` (kept for `label`); a DeltaError saying why it has none."""
        if self.field is None:
            return
        run = next(i for i in program.items if isinstance(i, ast.Sweep))
        try:
            self.anchors[rec.index] = field_position(self.field, ds, rec, spec, run)
        except DeltaError as e:
            raise DeltaError(f"align={self.text}: {e.message}") from None

    def label(self, rec: Record, run: ResolvedRun, token: int) -> str:
        """Token `token` of the record's sweep `run` named from the anchor."""
        if self.field is None:
            return str(token - len(run.token_ids))
        return ast.format_position(attrs.evolve(self.field, offset=token - self.anchors[rec.index]))


def offset(label: str) -> int:
    """A label's offset from its anchor: `-3` -> -3, `facts.subject + 2` -> 2."""
    label = label.strip()
    if re.fullmatch(r"-?\d+", label):
        return int(label)
    m = re.search(r"\s([+-])\s(\d+)$", label)
    return 0 if m is None else (int(m.group(2)) if m.group(1) == "+" else -int(m.group(2)))


def order(labels: Any) -> list[str]:
    return sorted(dict.fromkeys(labels), key=offset)


def any_per_token(resolved: Resolved) -> bool:
    """Whether a sweep of the program measures a number per token."""
    return any(per_token(m) for r in resolved.runs if r.kind == "sweep" for m in r.measures)


def anchored(program: ast.Program, ds: Dataset, good: list[tuple[Record, Resolved]],
             skipped: tuple[tuple[int, str], ...], alignment: Alignment, spec: ModelSpec,
             strict: bool) -> tuple[list[tuple[Record, Resolved]], tuple[tuple[int, str], ...]]:
    """The records whose anchor `alignment` finds (kept in it); the others left out with why (`strict`: the
    first is the error)."""
    kept, out = [], list(skipped)
    for rec, res in good:
        try:
            alignment.anchor(program, ds, rec, spec)
        except DeltaError as e:
            if strict:
                e.notes = (*e.notes, f"in record {rec.index + 1} ({ds.where(rec)})")
                raise
            out.append((rec.index, e.message))
            continue
        kept.append((rec, res))
    if not kept:
        raise DeltaError(f"none of the {len(ds.records)} records of '{ds.name}' has align={alignment.text}: nothing "
                         f"to run")
    return kept, tuple(sorted(out))


def per_token_lines(stats: Sequence[Any], align: str | None, shown: int = 8) -> list[str]:
    """Per cell and per-token measure (`CellStats` with a position), the aligned positions nearest the anchor."""
    lines: list[str] = []
    cells = dict.fromkeys((c.sweep, c.point, c.stats.measure) for c in stats if c.position is not None)
    for sweep, point, m in cells:
        got = [c for c in stats if (c.sweep, c.point, c.stats.measure) == (sweep, point, m) and c.position is not None]
        near = sorted(sorted(got, key=lambda c: abs(offset(c.position)))[:shown], key=lambda c: offset(c.position))
        at = ", ".join(f"{k}={v}" for k, v in point)
        lines.append(f"{sweep}[{at}] {m}, per token from {align or '-1'}"
                     + (f" ({len(got) - shown} more positions in summary.csv)" if len(got) > shown else ""))
        lines.extend(f"  {c.position:24} {format_stats(c.stats)}" for c in near)
    return lines


def aligned_records(program: ast.Program, ds: Dataset, good: list[tuple[Record, Resolved]],
                    skipped: tuple[tuple[int, str], ...], align: str | None, spec: ModelSpec, strict: bool
                    ) -> tuple[bool, Alignment, list[tuple[Record, Resolved]], tuple[tuple[int, str], ...]]:
    """(whether a sweep measures a number per token, the alignment, the records to run, those left out): with
    per-token measures each record's anchor is found (`anchored`); `align` without them is an error."""
    alignment = Alignment.parse(align, ds)
    if any_per_token(good[0][1]):
        return (True, alignment, *anchored(program, ds, good, skipped, alignment, spec, strict))
    if align is not None:
        raise DeltaError(f"align={align!r} names where a per-token measure's positions are counted from, and no "
                         f"sweep of the program measures one number per token: drop it")
    return False, alignment, good, skipped
