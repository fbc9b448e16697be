"""What a run wrote, read back: `load_results(DIR)`, and a collection as records and tensors (`Collection`).

    col = deltalang.load_results("out/")     # a collection (`deltalang.runs.collect`)
    record, x = col.dataset("s")[0]           # a torch Dataset of (record, tensor); "s": every block of `as s`
    X = col.stack("s")                        # [records, blocks, heads, key_dim, value_dim], if it fits in memory
    col.to_pandas()                           # the index: record, line, the fields, shard, row, tokens

`load_results(DIR)` gives back what any run saved, by the files it finds: a `Collection` (`collection.json`),
`results.Results` (a one-prompt run), or a `SavedTable` (`results.csv`, `sweep.csv`, `attribution.csv`;
`to_pandas()` is the CSV as written); an unfinished run or a foreign directory is a DeltaError naming
what is missing. A `Collection` reads shards lazily: `col[n]` is `(record, {label: tensor})`,
`dataset(name)` a torch Dataset, `stack(name)` one tensor (refused, with the figures, for ragged values or
more than half the available memory); a name is a label (`s.L0`) or an `as` name for its blocks. Its
`summary()` prints the reads, the measures' statistics (`summary.json`) and each record left out with its
data-file line; `files()` what the run wrote; `to_pandas()` (every one) needs pandas (`compat.pandas`).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset as TorchDataset

from deltalang.ground.compat import pandas
from deltalang.ground.datasets import left_out_lines
from deltalang.ground.errors import DeltaError

from .collect import INDEX, KIND, MANIFEST, PROGRESS, human
from .dataset_store import format_stats
from .results import Results
from .shards import count_line, part_from


class Collection:
    """A finished collection in DIR: its manifest, index and shards (see the module doc)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        try:
            self.manifest = json.loads((self.dir / MANIFEST).read_text(encoding="utf-8"))
            lines = (self.dir / INDEX).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError as e:
            raise DeltaError(f"{self.dir} holds no complete collection ({Path(e.filename).name} is missing): an "
                             f"unfinished run continues with --resume") from None
        self.records = sorted((json.loads(x) for x in lines if x.strip()), key=lambda e: e["record"])
        self.reads = {r["label"]: r for r in self.manifest["reads"]}

    @property
    def labels(self) -> list[str]:
        return list(self.reads)

    def __len__(self) -> int:
        return len(self.records)

    def _value(self, entry: dict[str, Any], label: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.dir / entry["shard"]), "pt") as f:
            if self.reads[label]["per_record"]:
                return f.get_tensor(f"{label}@{entry['record']}")
            return f.get_slice(label)[entry["row"]]

    def __getitem__(self, n: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        entry = self.records[n]
        return _record(entry), {label: self._value(entry, label) for label in self.reads}

    def __iter__(self) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        return (self[n] for n in range(len(self)))

    def select(self, name: str | None) -> list[str]:
        """The labels `name` stands for: itself, or an `as` name's blocks (`s` -> `s.L0`, `s.L1`, ...)."""
        if name is None and len(self.reads) == 1:
            return self.labels
        if name in self.reads:
            return [name]
        blocks = [lab for lab in self.reads if name is not None and lab.startswith(name + ".L")
                  and lab[len(name) + 2:].isdigit()]
        if not blocks:
            raise DeltaError(f"the collection in {self.dir} holds {', '.join(self.labels)}: name one of them (or an "
                             f"`as` name for all its blocks)" if name is None else
                             f"no read '{name}' in the collection in {self.dir}: it holds {', '.join(self.labels)}")
        return sorted(blocks, key=lambda lab: int(lab.rsplit(".L", 1)[1]))

    def value(self, n: int, name: str | None = None) -> torch.Tensor:
        """The n-th record's value of `name` (several blocks: stacked, block first)."""
        labels = self.select(name)
        vals = [self._value(self.records[n], lab) for lab in labels]
        return vals[0] if len(labels) == 1 else torch.stack(vals)

    def dataset(self, name: str | None = None) -> RecordDataset:
        """A `torch.utils.data.Dataset` of (record, tensor): the record's fields, line and number, and its value."""
        self.select(name)
        return RecordDataset(self, name)

    def stack(self, name: str | None = None) -> torch.Tensor:
        """Every record's value of `name` as one tensor, record axis first (refused if shapes differ or too big)."""
        labels = self.select(name)
        varying = [lab for lab in labels if self.reads[lab]["per_record"]]
        if varying:
            raise DeltaError(f"{varying[0]} has a length of each record's own (its axes {self.reads[varying[0]]['axes']}"
                             f"): iterate over collection.dataset({name!r}) instead of stacking it")
        parts = [self._stacked(lab) for lab in labels]
        return parts[0] if len(parts) == 1 else torch.stack(parts, 1)

    def _stacked(self, label: str) -> torch.Tensor:
        read = self.reads[label]
        dtype = getattr(torch, read["dtype"].lower().replace("f32", "float32").replace("bf16", "bfloat16")
                        .replace("f16", "float16").replace("i64", "int64"), torch.float32)
        out_shape = (len(self.records), *read["shape"])
        need = torch.Size(out_shape).numel() * torch.empty((), dtype=dtype).element_size()
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > avail // 2:
            raise DeltaError(f"stacking {label} takes {human(need)} and {human(avail)} of memory is available: "
                             f"iterate over collection.dataset({label!r}) instead")
        from safetensors import safe_open

        out = torch.empty(out_shape, dtype=dtype)
        by_shard: dict[str, list[tuple[int, int]]] = {}
        for pos, e in enumerate(self.records):
            by_shard.setdefault(e["shard"], []).append((pos, e["row"]))
        for shard, rows in by_shard.items():
            with safe_open(str(self.dir / shard), "pt") as f:
                t = f.get_tensor(label)
            pos, row = zip(*rows)
            out[list(pos)] = t[list(row)].to(dtype)
        return out

    def to_pandas(self) -> Any:
        """The index, a row per record: record, line, the fields, shard, row, tokens (and its measures)."""
        pd = pandas()

        return pd.DataFrame([{**_record(e), "shard": e["shard"], "row": e["row"], "tokens": e.get("tokens"),
                              **e.get("measures", {})} for e in self.records])

    def summary(self) -> str:
        """What `deltalang run` prints of a collection: records, bytes, each read's shape."""
        m = self.manifest
        saved = f"{self.dir}: {human(m.get('bytes', 0))} in {len(m.get('shards', []))} shard(s)"
        lines = [f"collected {len(self)} of {m.get('records', len(self))} records of '{m.get('dataset')}' into {saved}"]
        if (part := part_from(m.get("part"))) is not None:  # a shard's part (`deltalang.runs.shards`)
            lines = [count_line(str(m.get("dataset")), int(m.get("records", 0)), len(m.get("left_out", [])), part)
                     + (f"; collected into {saved}" if part.records else "")]
        for lab, r in self.reads.items():
            shape = "per record" if r["per_record"] else "[" + ", ".join(
                f"{a}={n}" for a, n in zip((r.get("axes") or [])[1:] or ["?"] * len(r["shape"]), r["shape"])) + "]"
            lines.append(f"  {lab:46} {r.get('dtype')} {shape}" + (f" axes {r['axes']}" if r["per_record"] else ""))
        summary = _json(self.dir / "summary.json") or {}
        lines += [f"{s['measure']:48} {format_stats(SimpleNamespace(**s))}" for s in summary.get("measures", [])]
        left = m.get("left_out", [])
        total = max(m.get("records", 0), max((e["record"] + 1 for e in left), default=0))
        lines += left_out_lines(m.get("dataset", ""), m.get("origin", ""), total, [(e["line"], e["why"]) for e in left])
        return "\n".join(lines)

    def files(self) -> list[str]:
        """The files the run wrote in DIR (its shards as one pattern, with their count)."""
        names = sorted(p.name for p in self.dir.iterdir() if p.is_file())
        shards = [n for n in names if n.startswith("shard-") and n.endswith(".safetensors")]
        first = [n for n in (INDEX, PROGRESS) if n in names]
        rest = [n for n in names if n not in (*shards, *first, MANIFEST)]
        shown = [f"shard-*.safetensors ({len(shards)})"] if len(shards) > 1 else shards
        return [*shown, *first, *rest, *([MANIFEST] if MANIFEST in names else [])]

    def __repr__(self) -> str:
        return "<deltalang Collection>\n" + _first_lines(self.summary())


class RecordDataset(TorchDataset):
    """A collection's (record, tensor) pairs as a `torch.utils.data.Dataset`."""

    def __init__(self, collection: Collection, name: str | None) -> None:
        self.collection, self.name = collection, name

    def __len__(self) -> int:
        return len(self.collection)

    def __getitem__(self, n: int) -> tuple[dict[str, Any], torch.Tensor]:
        return _record(self.collection.records[n]), self.collection.value(n, self.name)

    def __repr__(self) -> str:
        return f"<deltalang RecordDataset: {len(self)} records of {self.name or self.collection.labels[0]}>"


def _record(entry: dict[str, Any]) -> dict[str, Any]:
    return {"record": entry["record"], "line": entry["line"], **entry.get("fields", {})}


def _first_lines(text: str, n: int = 12) -> str:
    lines = text.splitlines()
    return "\n".join(lines[:n] + ([f"... ({len(lines) - n} more lines)"] if len(lines) > n else []))


class SavedTable:
    """A saved run's long-format table (`results.csv`, `sweep.csv` or `attribution.csv`) and its summary."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind, self.path = kind, path
        summary = path.parent / ("sweep.json" if path.name == "sweep.csv" else "summary.json")
        try:
            self.summary_data = json.loads(summary.read_text(encoding="utf-8")) if summary.is_file() else {}
        except ValueError:
            self.summary_data = {}
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            self.columns = list(reader.fieldnames or [])
            self.rows = [dict(r, value=float(r["value"])) if r.get("value") not in (None, "") else dict(r)
                         for r in reader]

    def to_pandas(self) -> Any:
        """The CSV as written: long format, its columns."""
        pd = pandas()

        return pd.read_csv(self.path, keep_default_na=False, na_values=[""], float_precision="round_trip")

    @property
    def measures(self) -> list[str]:
        return list(dict.fromkeys(r["measure"] for r in self.rows if "measure" in r))

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        head = [f"<deltalang saved {self.kind}: {len(self.rows)} rows from {self.path}>",
                f"  columns: {', '.join(self.columns)}"]
        head += [f"  {m}" for m in self.measures[:8]] + ([f"  ... {len(self.measures) - 8} more measures"]
                                                          if len(self.measures) > 8 else [])
        return "\n".join(head)


def load_results(directory: str | Path) -> Collection | Results | SavedTable:
    """What a run saved in `directory` (see the module doc)."""
    d = Path(directory)
    if not d.is_dir():
        raise DeltaError(f"no results in {directory}: not a directory")
    progress, shards = _json(d / PROGRESS), _json(d / "shards.json")
    if shards is not None and not shards.get("merged"):  # parts of a run split by --shard (`deltalang.merge`)
        raise DeltaError(f"{directory} holds the parts of a run split in {shards.get('n')} shards, not merged: "
                         f"`deltalang merge {directory}` (or deltalang.load_results) joins them")
    if (d / MANIFEST).is_file():
        return Collection(d)
    if progress is not None and not progress.get("complete", False):
        what = "collection" if progress.get("kind") == KIND else "run"
        raise DeltaError(f"{directory} holds an unfinished {what} ({progress.get('done')} record(s) done): "
                         f"continue it with --resume")
    if (d / "results.csv").is_file():
        cols = (d / "results.csv").read_text(encoding="utf-8").split("\n", 1)[0].split(",")
        kind = "attribution over a dataset" if "variant" in cols or "method" in cols else \
            "sweep over a dataset" if "sweep" in cols else "generate over a dataset" if "step" in cols else \
            "run over a dataset"
        return SavedTable(kind, d / "results.csv")
    for name, kind in (("attribution.csv", "attribution"), ("sweep.csv", "sweep")):
        if (d / name).is_file():
            return SavedTable(kind, d / name)
    if (d / "results.json").is_file():
        return _one_prompt(d)
    raise DeltaError(f"no deltalang results in {directory}: it holds no results.json, results.csv, sweep.csv, "
                     f"attribution.csv or {MANIFEST}")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _one_prompt(d: Path) -> Results:
    """A one-prompt run's `Results` from its results.json and results.safetensors."""
    meta = _json(d / "results.json") or {}
    values: dict[str, Any] = dict(meta.get("measures", {}))
    if (d / "results.safetensors").is_file():
        from safetensors.torch import load_file

        values.update(load_file(str(d / "results.safetensors")))
    program = (d / "program.dl").read_text(encoding="utf-8") if (d / "program.dl").is_file() else None
    code = (d / "emitted.py").read_text(encoding="utf-8") if (d / "emitted.py").is_file() else None
    return Results(values, program=program, code=code)
