"""A program over a dataset, made into one plain program per record: `check_over`, `expand`, `measure_label`.

    dataset facts = "facts.jsonl"
    trace t on facts { write L[linear].state_after(facts.subject) from facts.corrupt
                       measure logit_diff(facts.answer, facts.foil) }

`expand(record)` rewrites the program into the one-prompt program a researcher would write for that record
(the dataset a `prompt`, a donor field a prompt of its own read at the same position number, `from
facts.corrupt.VALUE` that prompt's VALUE (`state_output`: the donor's state after its last token), a field as a
position a quoted piece, a field as an answer that token), spans kept so errors point at the field.
`check_over` checks what holds for every record first: one dataset, which runs and reads it allows, fields
only inside runs on it and present in every record (else an error naming the first record without one).
`measure_label` names a measure as the template writes it, the same for every record.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Mapping

import attrs

from deltalang.ground.datasets import Dataset, Record
from deltalang.ground.errors import DeltaError, DeltaErrors, DeltaResolveError, Span
from deltalang.models.spec import ModelSpec
from deltalang.models.values import MODEL_VALUES

from .. import ast
from ..ir import ResolvedMeasure, measure_call_text, measure_result_name, site_text
from ..tokens import tokenize

PROMPT_FIELD = "prompt"
MEASURE_TYPES = (ast.Prob, ast.Rank, ast.LogitDiff, ast.KL, ast.Norm)


def dataset_decls(program: ast.Program) -> list[ast.DatasetDecl]:
    """The program's `dataset` declarations, in source order."""
    return [i for i in program.items if isinstance(i, ast.DatasetDecl)]


def uses_dataset(program: ast.Program) -> bool:
    """Whether the program declares a dataset or names a field (then it runs per record)."""
    return any(isinstance(n, (ast.DatasetDecl, ast.Field)) or (isinstance(n, ast.RUN_TYPES) and "." in n.prompt)
               for n in ast.walk(program))


def donor_field(node: ast.FromSource, ds_name: str, block_vars: set[str]) -> str | None:
    """The field a `from` on the dataset names as its donor: `from facts.corrupt` (a field, known or not) or
    `from facts.corrupt.state_output`, `from facts.corrupt.state_after(-1)` (the parser reads `corrupt` there as a
    block, but no block is a bare name other than a sweep variable's); None for `from facts`, `from facts.L2.VALUE`."""
    site = node.site
    if node.run != ds_name or site is None:
        return None
    if site.block is None:
        return site.value if site.value not in MODEL_VALUES and site.position is None else None
    if isinstance(site.block, ast.BlockVar) and site.block.name not in block_vars:
        return site.block.name
    return None


def sweep_vars(program: ast.Program) -> set[str]:
    """Every sweep variable's name: a bare name used as a block there is that variable, not a field."""
    return {a.var for i in program.items if isinstance(i, ast.Sweep) for a in i.axes}


def on_dataset(run: Any, names: Any) -> str | None:
    """The dataset a run is on (`on facts`, or a field's text `on facts.corrupt`), or None."""
    if not isinstance(run, ast.RUN_TYPES):
        return None
    head = run.prompt.split(".", 1)[0]
    return head if head in names else None


def _fail(message: str, span: Span, notes: tuple[str, ...] = ()) -> DeltaError:
    return DeltaResolveError(message, span if span != ast.NOSPAN else None, notes=notes)


def check_over(program: ast.Program, datasets: Mapping[str, Dataset]) -> Dataset:
    """Check the program's use of its dataset (see the module doc); return the dataset its runs are on."""
    decls = {d.name: d for d in dataset_decls(program)}
    names = set(decls) | set(datasets)
    runs = [i for i in program.items if on_dataset(i, names) is not None]
    dotted = next((i for i in program.items if isinstance(i, ast.RUN_TYPES) and "." in i.prompt
                   and on_dataset(i, names) is None), None)
    if dotted is not None:
        head = dotted.prompt.split(".", 1)[0]
        raise _fail(f"'{dotted.prompt}': no dataset named '{head}' (a run on a field is `on DATASET.FIELD`)",
                    dotted.span)
    if not runs:
        where = next(iter(decls.values())).span if decls else program.span
        raise _fail("the program declares a dataset but no run is on it: trace NAME on DATASET { ... }", where)
    ds_name = on_dataset(runs[0], names)
    for run in runs:
        if on_dataset(run, names) != ds_name:
            raise _fail(f"runs over two datasets ('{ds_name}', '{run.prompt}'): a program runs over one", run.span)
        for st in run.body:
            if isinstance(run, ast.Sweep) and isinstance(st, ast.Read):  # a trace's reads: a collection
                raise _fail("a sweep over a dataset keeps measures, one per record and cell: use 'measure' (e.g. "
                            "norm(SITE)), not 'read' (a trace on the dataset collects reads)", st.span)
            read = st.body if isinstance(st, ast.Step) else st
            if isinstance(run, ast.Generate) and isinstance(read, ast.Read) and \
                    any(site.value != "tokens" for site in read.sites):  # its tokens are kept anyway
                raise _fail("a generate over a dataset keeps each record's continuation and measures, one per "
                            "step: use 'measure' (e.g. norm(SITE)), not 'read' (a trace on the dataset collects "
                            "reads)", st.span)
            for top in (n for n in ast.walk(st) if isinstance(n, ast.Top)):
                raise _fail(f"top({top.k}) gives tokens, not a number, and a run over a dataset averages numbers: "
                            f"measure prob(...) or rank(...) of a token", top.span)
    if ds_name not in datasets:
        raise _fail(f"no data for the dataset '{ds_name}'", decls[ds_name].span if ds_name in decls else runs[0].span)
    ds = datasets[ds_name]
    inside = {id(n) for r in runs for n in ast.walk(r)}
    block_vars = sweep_vars(program)
    used: list[tuple[str, Span]] = []
    needs = prompt_use(program, runs, ds_name)
    if needs is not None:
        used.append((PROMPT_FIELD, needs))
    used.extend((r.prompt.split(".", 1)[1], r.span) for r in runs if "." in r.prompt)
    for node in ast.walk(program):
        if isinstance(node, ast.Field):
            if node.dataset != ds_name or id(node) not in inside:
                raise _fail(f"'{node.dataset}.{node.field}': a dataset's fields are used inside a run on it "
                            f"(trace NAME on {ds_name} {{ ... }})", node.span)
            used.append((node.field, node.span))
    for item in program.items:
        if isinstance(item, ast.RUN_TYPES):
            for node in ast.walk(item.body):
                if isinstance(node, ast.FromSource) and on_dataset(item, names):
                    field = donor_field(node, ds_name, block_vars)
                    if field is not None and node.site is not None:
                        span = node.site.span if node.site.block is None else node.site.block.span
                        used.append((field, span))
    _check_fields(ds, used)
    return ds


def prompt_use(program: ast.Program, runs: list[Any], ds_name: str) -> Span | None:
    """Where the program needs its records' `prompt` field, or None: a run on the dataset itself, the
    dataset named as a run (`from facts`, `kl(facts)`, `mean(facts)`), or a position from a field (such
    positions are the prompt's token numbers). A program whose runs are all on other fields
    (`trace t on facts.text`) needs no `prompt`."""
    bare = next((r for r in runs if "." not in r.prompt), None)
    if bare is not None:
        return bare.span
    block_vars = sweep_vars(program)
    for node in ast.walk(program):
        if isinstance(node, ast.FromSource) and node.run == ds_name:
            if donor_field(node, ds_name, block_vars) is None:
                return node.span
        elif (isinstance(node, ast.KL) and node.run == ds_name) or \
                (isinstance(node, ast.MeanSource) and ds_name in node.prompts) or isinstance(node, ast.FieldPos):
            return node.span
        elif isinstance(node, ast.Site) and isinstance(node.position, ast.Field):
            return node.position.span
    return None


def _check_fields(ds: Dataset, used: list[tuple[str, Span]]) -> None:
    """Every field used is in some record (else unknown) and in every record (else the first without it):
    every such error of the program at once, in source order."""
    have = ds.fields
    errors: list[DeltaError] = []
    for field, span in dict.fromkeys(used):
        if field not in have:
            guess = difflib.get_close_matches(field, have, n=1)
            hint = f"did you mean '{guess[0]}'? " if guess else ""
            why = ("this uses the records' prompt: a run on the dataset itself, the dataset named as a run, or a "
                   "position from a field (a token number of the prompt)",) if field == PROMPT_FIELD else ()
            errors.append(_fail(f"no record of '{ds.name}' has a field '{field}': {hint}its fields are "
                                f"{', '.join(have)}", span, notes=why))
            continue
        missing = next((r for r in ds.records if field not in r.fields), None)
        if missing is not None:
            errors.append(_fail(f"record {missing.index + 1} of '{ds.name}' ({ds.where(missing)}) has no field "
                                f"'{field}'", span))
    errors.sort(key=lambda e: (e.span.line, e.span.column) if e.span else (0, 0))
    if errors:
        raise errors[0] if len(errors) == 1 else DeltaErrors(errors)


def expand(program: ast.Program, ds: Dataset, record: Record, spec: ModelSpec | None = None) -> ast.Program:
    """The plain program for one record (see the module doc); `spec` tokenizes positions from fields."""
    donors: dict[str, str] = {}  # field -> prompt name
    where = axis_positions(program, ds, record, spec) if spec is not None else {}

    def donor(field: str) -> str:
        return donors.setdefault(field, field_prompt(program, ds, field))

    block_vars = sweep_vars(program)

    def rewriter(run: Any) -> Callable[[Any], Any]:
        on_field = isinstance(run, ast.RUN_TYPES) and "." in run.prompt

        def rewrite(node: Any) -> Any:
            if isinstance(node, ast.Field):
                return record.fields[node.field]
            if isinstance(node, ast.Site) and isinstance(node.position, ast.Field):
                if on_field:  # a token number of the record's prompt, the same in the aligned text
                    spot = ast.FieldPos(node.position, span=node.position.span)
                    pos: Any = ast.IntPos(field_position(spot, ds, record, spec, run), span=spot.span)
                else:
                    pos = ast.PiecePos(record.fields[node.position.field], span=node.position.span)
                return attrs.evolve(node, position=pos)
            field = donor_field(node, ds.name, block_vars) if isinstance(node, ast.FromSource) else None
            if field is not None and field in ds.fields and node.site is not None:
                site = None if node.site.block is None else attrs.evolve(node.site, block=None)  # its VALUE
                return ast.FromSource(donor(field), site, span=node.span, at=_donor_piece(node.at, record))
            if isinstance(node, ast.FromSource) and isinstance(node.at, ast.Field):  # `from facts at facts.x`
                return attrs.evolve(node, at=_donor_piece(node.at, record))
            if isinstance(node, ast.Axis) and isinstance(node.domain, ast.PosList) and isinstance(run, ast.Sweep):
                return attrs.evolve(node, domain=_written_list(node.domain, where[(run.name, node.var)]))
            return None
        return rewrite

    items: list[Any] = []
    for item in program.items:
        if isinstance(item, ast.DatasetDecl):
            if item.name == ds.name:
                if PROMPT_FIELD in record.fields:  # else no run uses it (check_over)
                    items.append(ast.PromptDecl(ds.name, record.fields[PROMPT_FIELD], span=item.span))
                items.append(item)  # a placeholder: the donor prompts go here
            continue
        new = _map(item, rewriter(item))
        if isinstance(item, ast.RUN_TYPES) and "." in item.prompt:
            new = attrs.evolve(new, prompt=donor(item.prompt.split(".", 1)[1]))
        items.append(new)
    if not any(isinstance(i, ast.DatasetDecl) for i in items):  # data given from Python: no declaration
        items.insert(0, ast.DatasetDecl(ds.name, ""))
        if PROMPT_FIELD in record.fields:
            items.insert(0, ast.PromptDecl(ds.name, record.fields[PROMPT_FIELD]))
    at = next(n for n, i in enumerate(items) if isinstance(i, ast.DatasetDecl))
    extra = [ast.PromptDecl(name, record.fields[f], span=items[at].span) for f, name in donors.items()]
    items[at:at + 1] = extra
    return attrs.evolve(program, items=tuple(items))


def _donor_piece(at: Any, record: Record) -> Any:
    """`at facts.foil_subject`: the record's text of the field, a quoted piece found in the donor's prompt."""
    return ast.PiecePos(record.fields[at.field], span=at.span) if isinstance(at, ast.Field) else at


def field_prompt(program: ast.Program, ds: Dataset, field: str) -> str:
    """The prompt a record's program declares for a field's text: `facts_corrupt` (`_` added while taken)."""
    taken = {getattr(i, "name", None) for i in program.items}
    name = f"{ds.name}_{field}"
    while name in taken:
        name += "_"
    return name


def _written_list(d: ast.PosList, positions: tuple[int, ...]) -> ast.PosList:
    """A record's list of positions as its plain program writes it: each token once (the first item naming it),
    a field's position as its number, a number from the end as written (a donor counts it from its own end)."""
    out: list[ast.AxisPos] = []
    seen: set[int] = set()
    for p, at in zip(d.items, positions, strict=True):
        if at not in seen:
            seen.add(at)
            out.append(p if isinstance(p, ast.IntPos) else ast.IntPos(at, span=p.span))
    return attrs.evolve(d, items=tuple(out))


def axis_positions(program: ast.Program, ds: Dataset, record: Record,
                   spec: ModelSpec) -> dict[tuple[str, str], tuple[int, ...]]:
    """{(sweep, variable): the token each item of its list of positions names in this record} (non-negative,
    in the sweep's prompt; several items may name one token). A DeltaResolveError where an item has none."""
    out: dict[tuple[str, str], tuple[int, ...]] = {}
    for run in program.items:
        if not isinstance(run, ast.Sweep) or on_dataset(run, {ds.name}) is None:
            continue
        n = len(tokenize(spec, _run_text(run, record)))
        for axis in run.axes:
            if isinstance(axis.domain, ast.PosList):
                got = []
                for p in axis.domain.items:
                    if isinstance(p, ast.FieldPos):
                        got.append(field_position(p, ds, record, spec, run))
                    elif isinstance(p, ast.IntPos) and -n <= p.value < n:
                        got.append(p.value % n)
                    elif isinstance(p, ast.IntPos):
                        raise _fail(f"{axis.var} reaches {p.value}: past the end of the record's "
                                    f"{_run_field(run)} ({n} tokens)", p.span)
                    else:
                        raise _fail("a sweep over a dataset takes positions from a record's fields (facts.subject) "
                                    "or numbers (-1): a quoted piece is in one prompt only", p.span)
                out[(run.name, axis.var)] = tuple(got)
    return out


def _run_field(run: Any) -> str:
    return run.prompt.split(".", 1)[1] if "." in run.prompt else PROMPT_FIELD


def _run_text(run: Any, record: Record) -> str:
    return record.fields[_run_field(run)]


def field_position(p: ast.FieldPos, ds: Dataset, record: Record, spec: ModelSpec | None, run: Any) -> int:
    """The token `facts.subject[0] + 1` names in a record: of the field's text's first occurrence in the
    record's prompt, its token `index` (default its last), plus `offset`. A run on another field's text
    (`on facts.corrupt`) takes the same number, so that text must have as many tokens as the prompt."""
    if spec is None:
        raise DeltaError("positions from a record's fields need the model's tokenizer")
    text, piece = record.fields[PROMPT_FIELD], record.fields[p.field.field]
    toks = tokenize(spec, text)
    shown = ast.format_position(p)
    start = text.find(piece) if piece else -1
    if start < 0:
        raise _fail(f"'{p.field.dataset}.{p.field.field}' ({ast.quote(piece)}) does not occur in the record's "
                    f"prompt {ast.quote(text)}", p.span)
    cover = [i for i, (a, b) in enumerate(toks.offsets) if b > a and a < start + len(piece) and b > start]
    k = -1 if p.index is None else p.index
    if not -len(cover) <= k < len(cover):
        raise _fail(f"{shown}: {ast.quote(piece)} is {len(cover)} token(s) of the record's prompt", p.span)
    at = cover[k] + p.offset
    if not 0 <= at < len(toks):
        raise _fail(f"{shown} is token {at}, outside the record's prompt ({len(toks)} tokens)", p.span)
    field = _run_field(run)
    if field != PROMPT_FIELD and len(tokenize(spec, record.fields[field])) != len(toks):
        m = len(tokenize(spec, record.fields[field]))
        raise _fail(f"the record's {field} has {m} tokens and its prompt {len(toks)}: positions from fields are the "
                    f"prompt's token numbers, so a run on {ds.name}.{field} needs it aligned token for token",
                    p.span)
    return at


def _map(node: Any, fn: Callable[[Any], Any]) -> Any:
    """`node` with every sub-node `fn` rewrites (not None) replaced, depth first from the top."""
    new = fn(node)
    if new is not None:
        node = new
        if not attrs.has(type(node)):
            return node
    if attrs.has(type(node)):
        changes = {f.name: _map(getattr(node, f.name), fn) for f in attrs.fields(type(node))
                   if f.name not in ("span", "comments")}
        return attrs.evolve(node, **changes)
    if isinstance(node, tuple):
        return tuple(_map(x, fn) for x in node)
    return node


def measure_label(program: ast.Program, run: str, m: ResolvedMeasure) -> str:
    """A record's measure named as the template writes it: `t.logit_diff(facts.answer, facts.foil)`."""
    call = next((n for n in ast.walk(program) if isinstance(n, MEASURE_TYPES) and n.span == m.span
                 and m.span != ast.NOSPAN), None)
    multi = m.alias is not None and m.result_name != m.alias
    if call is None:
        return m.result_name
    if isinstance(call, ast.Norm):
        pos = None if call.site.position is None else ast.format_position(call.site.position)
        text = f"norm({site_text(m.layer, m.value or '', pos)})"
    elif isinstance(call, ast.KL):
        text = measure_call_text("kl", (), m.against, "")
    else:
        text = ast.format_measure(call)
    stmt = next((n for n in ast.walk(program) if isinstance(n, ast.Measure) and any(c is call for c in n.calls)),
                None)
    if m.at is not None and stmt is not None and stmt.at is not None:  # `at -2` as written, in every record
        text += f" at {ast.format_position(stmt.at)}"
    return measure_result_name(run, m.step, text, m.alias, m.layer, multi)
