"""A donor over a dataset that reads another token than the clean record has there: `donor_token_warnings`.

`from facts.corrupt` reads each record's donor at the clean record's token number, as `from PROMPT` does.
Where the two prompts differ in length (a donor phrased otherwise, not aligned token for token as causal
tracing's are), this compares, at each position a plain `from` reads, the clean token with the donor's,
and gives one warning per such write at its `from`: how many records differ, the first with its two
tokens, and `at FIELD`, which names the donor's own position. Decode-step writes and `= EXPR` operands are
not compared. Depends on `ast`, `datasets`, `errors` and `ir` only.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from deltalang.ground import display
from deltalang.ground.datasets import Dataset, Record
from deltalang.ground.errors import RecordsWarning, Span

from .. import ast
from ..ir import FromRun, Resolved, ResolvedOp


@attrs.frozen
class Mismatch:
    """One record's first position where its donor's token differs from the clean run's."""

    record: Record
    position: int
    clean: str
    donor_position: int
    donor: str
    clean_tokens: int
    donor_tokens: int


def plain_donors(program: ast.Program) -> dict[Span, ast.FromSource]:
    """{a write's span: its `from` source} for every write whose donor reads the target's own position."""
    out: dict[Span, ast.FromSource] = {}
    for node in ast.walk(program):
        if isinstance(node, ast.Write) and isinstance(node.source, ast.FromSource):
            src = node.source
            if src.at is None and (src.site is None or src.site.position is None):
                out[node.span] = src
    return out


def first_mismatch(record: Record, resolved: Resolved, span: Span) -> Mismatch | None:
    """The first position a write at `span` reads from its donor where the donor's token is another."""
    for run in resolved.runs:
        for op in run.ops:
            if op.kind != "write" or op.span != span or not isinstance(op.source, FromRun):
                continue
            try:
                donor = resolved.run(op.source.run)
            except KeyError:
                continue
            if len(donor.token_ids) == len(run.token_ids):  # aligned token for token: numbers are the convention
                continue
            for c, d in _pairs(op):
                if c < len(run.token_ids) and d < len(donor.token_ids) and \
                        run.token_ids[c] != donor.token_ids[d]:
                    return Mismatch(record, c, run.tokens[c], d, donor.tokens[d], len(run.token_ids),
                                    len(donor.token_ids))
    return None


def _pairs(op: ResolvedOp) -> list[tuple[int, int]]:
    """(clean position, donor position) of each token the write takes from its donor (none at a decode step)."""
    src = op.source
    assert isinstance(src, FromRun)
    if (op.step or 0) > 0:
        return []
    if src.position_map:
        return list(src.position_map)
    if src.position is not None and op.position is not None:
        return [(op.position, src.position)]
    return []


def donor_token_warnings(program: ast.Program, ds: Dataset,
                         records: Sequence[tuple[Record, Resolved]]) -> list[RecordsWarning]:
    """One warning per plain `from` write whose donor reads, in some record, a token other than the clean one."""
    out: list[RecordsWarning] = []
    for span, src in plain_donors(program).items():
        found = [m for m in (first_mismatch(r, res, span) for r, res in records) if m is not None]
        if not found:
            continue
        m = found[0]
        donor = ast.format_source(src)[len("from "):]
        field = f"{ds.name}.FIELD" if src.run == ds.name else '"PIECE"'
        out.append(RecordsWarning(
            f"in {len(found)} of {len(records)} records of '{ds.name}' the donor {donor} has another number of "
            f"tokens than the clean prompt and is read at another token: record {m.record.index + 1} "
            f"({ds.where(m.record)}) has {display.token(m.clean)} at {m.position} of {m.clean_tokens}, its donor "
            f"{display.token(m.donor)} at "
            f"{m.donor_position} of {m.donor_tokens}; name the donor's own position: from {donor} at {field}",
            src.span,
            notes=[f"records that differ: {ds.listed([m.record for m in found])}"] if len(found) > 1 else []))
    return out


def with_warnings(resolved: Resolved, extra: Sequence[Any], source: str, filename: str) -> Resolved:
    """`resolved` with `extra` warnings after its own, located in `source`."""
    located = [w.located(source, filename) if source else w for w in extra]
    return attrs.evolve(resolved, warnings=(*resolved.warnings, *located))

