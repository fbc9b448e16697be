"""Datasets: records of named text fields, loaded from JSONL, CSV or TSV files or given from Python.

    ds = load_dataset("facts", Path("examples/data/landmarks.jsonl"))
    ds.records[0].fields["subject"], ds.records[0].line

A `Dataset` is a name, its source and its `Record`s in file order (0-based `index`, the data-file `line`
it starts on, fields as strings). Nothing is evaluated: JSON values must be strings (numbers kept as
text, null a missing field), CSV/TSV cells are text; the format is the suffix (`.jsonl`/`.ndjson`,
`.csv`, `.tsv`). Every problem is one `DeltaError` naming the file and line. Which fields a program uses
is checked by `deltalang.language.resolve.dataset`, not here.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs

from .errors import DeltaError, Span

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv"}


@attrs.frozen
class Record:
    """One record: its 0-based index, the data-file line it starts on, its fields."""

    index: int
    line: int
    fields: Mapping[str, str]


@attrs.frozen
class Dataset:
    """A named dataset: where it came from (`origin`: a path, or `<data>`) and its records."""

    name: str
    origin: str
    records: tuple[Record, ...]

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field some record has, in first-seen order."""
        seen: dict[str, None] = {}
        for r in self.records:
            seen.update(dict.fromkeys(r.fields))
        return tuple(seen)

    def left_out_lines(self, skipped: Sequence[tuple[int, str]]) -> list[str]:
        """What a summary prints of the records left out (`(record index, why)`): none, or a line and one per record."""
        return left_out_lines(self.name, self.origin, len(self.records),
                              [(self.records[i].line, why) for i, why in skipped])

    def where(self, record: Record) -> str:
        """`facts.jsonl:3` (a file's line) or `<data>: row 3` (data given from Python)."""
        return place(self.name, self.origin, record.line)

    def listed(self, records: Sequence[Record], most: int = 5) -> str:
        """`2 (facts.jsonl:2), 4 (facts.jsonl:4) and 3 more`: records as a warning names them."""
        shown = ", ".join(f"{r.index + 1} ({self.where(r)})" for r in records[:most])
        return shown + (f" and {len(records) - most} more" if len(records) > most else "")


def place(name: str, origin: str, line: int) -> str:
    """Where dataset `name`'s record of data-file line `line` is: `facts.jsonl:3`, or `data 'facts' row 3` (data
    given from Python, `origin` `<data>`)."""
    return f"{origin}:{line}" if origin != "<data>" else f"data '{name}' row {line}"


def left_out_lines(name: str, origin: str, total: int, skipped: Sequence[tuple[int, str]]) -> list[str]:
    """What a summary prints of the records left out of dataset `name`'s `total` (`(data-file line, why)`, as a
    saved manifest keeps them too): none, or a line and one per record."""
    if not skipped:
        return []
    return [f"left out {len(skipped)} of {total} records (--strict stops instead):",
            *(f"  {place(name, origin, line)}: {why}" for line, why in skipped)]


def data_error(origin: str, line: int | None, message: str) -> DeltaError:
    """A one-line error about a data file: `facts.jsonl:3:1: error: ...` (or `facts.jsonl: error: ...`)."""
    if line is None:
        return DeltaError(message, source="", filename=origin)
    return DeltaError(message, Span(line, 1, line, 2), source="", filename=origin)


def load_dataset(name: str, path: Path, shown: str | None = None) -> Dataset:
    """The records of the file at `path` (`shown`: how errors name it, default the path)."""
    origin = shown or str(path)
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise data_error(origin, None, f"the dataset '{name}' must be a .jsonl, .csv or .tsv file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise data_error(origin, None, f"the dataset '{name}': no such file") from None
    except OSError as e:
        raise data_error(origin, None, f"the dataset '{name}' cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise data_error(origin, line, f"not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8") from None
    records = _jsonl(text, origin) if kind == "jsonl" else _table(text, origin, "," if kind == "csv" else "\t")
    if not records:
        raise data_error(origin, None, f"the dataset '{name}' has no records")
    return Dataset(name, origin, tuple(records))


def _text_fields(obj: Any, origin: str, line: int | None) -> dict[str, str]:
    """A record's fields as strings; a record that is not an object of text or numbers is an error."""
    if not isinstance(obj, dict):
        raise data_error(origin, line, f"a record is an object of text fields, not {type(obj).__name__}")
    out: dict[str, str] = {}
    for k, v in obj.items():
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue  # null, or a DataFrame's empty cell: the record lacks the field
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise data_error(origin, line, f"field '{k}' is {type(v).__name__}; fields are text")
        out[str(k)] = v if isinstance(v, str) else json.dumps(v)
    return out


def _jsonl(text: str, origin: str) -> list[Record]:
    out: list[Record] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise data_error(origin, n, f"malformed JSON line: {e.msg} (column {e.colno})") from None
        out.append(Record(len(out), n, _text_fields(obj, origin, n)))
    return out


def _table(text: str, origin: str, delimiter: str) -> list[Record]:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    try:
        header = next(reader, None)
        if header is None:
            return []
        names = [h.strip() for h in header]
        if any(not h for h in names) or len(set(names)) != len(names):
            raise data_error(origin, 1, "the header row needs a distinct, non-empty name for every column")
        out: list[Record] = []
        start = reader.line_num + 1
        for row in reader:
            if not any(cell.strip() for cell in row):
                start = reader.line_num + 1
                continue
            if len(row) != len(names):
                raise data_error(origin, start, f"{len(row)} cells where the header has {len(names)}")
            out.append(Record(len(out), start, dict(zip(names, row, strict=True))))
            start = reader.line_num + 1
    except csv.Error as e:
        raise data_error(origin, reader.line_num, f"malformed line: {e}") from None
    return out


def dataset_from_python(name: str, data: Any) -> Dataset:
    """A dataset given from Python: a list of dicts, or a pandas DataFrame (its rows; `line` is the row, from 1)."""
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame, without importing pandas
        data = data.to_dict(orient="records")
    if isinstance(data, (str, bytes)) or not hasattr(data, "__iter__"):
        raise DeltaError(f"data['{name}'] must be a list of dicts or a pandas DataFrame, not {type(data).__name__}")
    origin = "<data>"
    records = [Record(i, i + 1, _text_fields(obj, f"data '{name}' row {i + 1}", None)) for i, obj in enumerate(data)]
    if not records:
        raise DeltaError(f"data['{name}'] has no records")
    return Dataset(name, origin, tuple(records))
