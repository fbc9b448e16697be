"""`deltalang check` and `deltalang fmt`: a program checked against a model, without running it.

`check()` parses and resolves a program and returns the `Resolved` program;
`format_resolved()` prints it the way `deltalang check` shows it: every run,
every op in source order, and what every position resolved to, with the token
there (`L0.state_after("Tower") -> position 3 ('ĠTower')`). Counting tokens by
hand is the slip researchers make most; this is where they see the count.

The resolver's warnings (`Resolved.warnings`) are part of what `check` prints,
rendered like errors, before its last line; `check()` also sends each through
Python's `warnings` module (a `DeltaWarning`), so a notebook shows them.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from . import ast
from .cli import read_program
from .errors import DeltaError, DeltaModelError, DeltaWarning, warn
from .parse import parse
from .resolve import FromRun, Mean, Named, Resolved, ResolvedMeasure, ResolvedOp, ResolvedRun, Scale, Zeros, resolve
from .spec import ModelSpec, load_spec


def _spec_for(model: Any, program: ast.Program, trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec from: a ModelSpec, an object with `.spec`, a path or id, or None.

    None means the program's own `model "ID"` line, else the bundled model.
    """
    if isinstance(model, ModelSpec):
        return model
    spec = getattr(model, "spec", None)
    if isinstance(spec, ModelSpec):
        return spec
    if model is None:
        declared = next((i.name for i in program.items if isinstance(i, ast.ModelDecl)), None)
        return load_spec(declared, trust_remote_code=trust_remote_code)
    if isinstance(model, (str, Path)):
        return load_spec(model, trust_remote_code=trust_remote_code)
    raise DeltaModelError(f"not a model: {model!r}; pass a checkpoint path, a ModelSpec or a loaded model")


def check(text: str, model: Any = None, *, filename: str = "<program>", prompt: str | None = None,
          trust_remote_code: bool = False) -> Resolved:
    """Parse and resolve a program against a model's config and tokenizer. Raises a located DeltaError.

    `model`: None (the program's `model` line, else the bundled model), a checkpoint
    path or id, a `ModelSpec`, or anything with a `.spec` (a loaded model).
    `prompt`: the prompt of the implicit top-level run `main` (the CLI's --prompt).
    Every warning of the program (`.warnings` of the result) also goes through `warnings.warn`.
    """
    program = parse(text, filename)
    try:
        spec = _spec_for(model, program, trust_remote_code)
        resolved = resolve(program, spec, prompt_override=prompt, source=text, filename=filename)
    except DeltaError as e:
        raise e.located(text, filename) from None
    for w in resolved.warnings:
        warn(w)
    return resolved


# ---- printing -------------------------------------------------------------------


def _token(run_or_tokens: Any, position: int | None) -> str:
    """` ('ĠTower')`: the token at a position, or which generated token it is."""
    tokens = run_or_tokens.tokens if isinstance(run_or_tokens, ResolvedRun) else run_or_tokens
    if position is None or position < 0:
        return ""
    if position >= len(tokens):
        return f" (new token {position - len(tokens) + 1})"
    return f" ({tokens[position]!r})"


def describe_model(spec: ModelSpec) -> str:
    """`NAME: qwen3_5, 4 blocks (DeltaNet L0 L1 L2; attention L3)`."""
    lin = " ".join(f"L{i}" for i in spec.linear_layers()) or "none"
    att = " ".join(f"L{i}" for i in spec.attention_layers()) or "none"
    return f"{spec.model_id}: {spec.family.name}, {spec.num_layers} blocks (DeltaNet {lin}; attention {att})"


def _token_table(tokens: tuple[str, ...], width: int = 96) -> list[str]:
    """`0 'T'  1 'h'  2 'e' ...`, wrapped."""
    lines: list[str] = []
    cur = ""
    for i, t in enumerate(tokens):
        cell = f"{i} {t!r}"
        if cur and len(cur) + 2 + len(cell) > width:
            lines.append(cur)
            cur = cell
        else:
            cur = f"{cur}  {cell}" if cur else cell
    if cur:
        lines.append(cur)
    return lines


def _position_note(position: int | None, position_var: str | None, tokens: tuple[str, ...]) -> str:
    """` -> position 15 ('r')` for a resolved position, else nothing."""
    if position_var is not None or position is None:
        return ""
    return f" -> position {position}{_token(tokens, position)}"


def _format_source(src: Any, resolved: Resolved) -> str:
    """A write's source with its donor site and positions made explicit."""
    if isinstance(src, FromRun):
        donor = next((r for r in resolved.runs if r.name == src.run), None)
        pos: Any = src.position if src.position_var is None else f"{{{src.position_var}}}"
        text = f"from {src.run}" + ("" if src.step is None else f".step{src.step}") + "."
        layer = src.layer
        if src.layer_var is not None:
            text += f"L{{{src.layer_var}}}."
        elif layer is not None:
            text += f"L{layer}."
        text += src.value if pos is None else f"{src.value}({pos})"
        if donor is not None and src.position is not None:
            text += _token(donor, src.position)
        if src.position_map:
            text += f" ({src.position_var}: " + " ".join(f"{a}->{b}" for a, b in src.position_map) + ")"
        return text
    if isinstance(src, Zeros):
        return "= zeros"
    if isinstance(src, Named):
        return f"= {src.name} (read in {src.run})"
    if isinstance(src, Scale):
        return f"*= {ast.format_number(src.factor)}"
    if isinstance(src, Mean):
        n = len(src.texts)
        where = "" if not src.positions else ", positions " + " ".join(str(p) for p in src.positions)
        return f"= mean({', '.join(src.prompts)}: {n} prompt{'s' if n != 1 else ''}{where})"
    return "?"


def format_op(op: ResolvedOp, run: ResolvedRun, resolved: Resolved) -> str:
    """One op as `check` prints it."""
    step = "" if op.step is None else f"step {op.step}: "
    where = _position_note(op.position, op.position_var, run.tokens)
    if op.kind == "read":
        return f"{step}read {op.written}{where} as {op.result_name}"
    return f"{step}write {op.written}{where} {_format_source(op.source, resolved)}"


def format_run_header(run: ResolvedRun) -> str:
    """`trace NAME on PROMPT (N tokens)`, with max_new_tokens, route, and a sweep's axes resolved."""
    n = len(run.token_ids)
    head = f"{run.kind} {run.name} on {run.prompt} ({n} token{'s' if n != 1 else ''})"
    if run.max_new_tokens is not None:
        head += f", max_new_tokens {run.max_new_tokens}"
    if run.route is not None:
        head += f", route {run.route}"
    if run.implicit:
        why = "the statements outside any block" if run.name == "main" else "a clean run, named in from/kl"
        head += f"  [implicit: {why}]"
    for a in run.axes:
        if a.kind == "block":
            head += f"\n  over {a.var} in " + " ".join(f"L{b}" for b in a.values)
        else:
            cells = " ".join(f"{p}{_token(run, p)}" for p in a.values)
            head += f"\n  over {a.var} in {a.labels[0]}..{a.labels[-1] + 1}: positions {cells}"
    return head


def format_resolved(resolved: Resolved) -> str:
    """What `deltalang check` prints for a valid program."""
    spec = resolved.spec
    lines = [f"model {describe_model(spec)}"]
    for name, text in resolved.prompts.items():
        if isinstance(text, str):
            run = next((r for r in resolved.runs if r.prompt == name), None)
            tokens = run.tokens if run is not None else _spell(spec, text)
            lines.append(f"prompt {name} = {ast.quote(text)}: {len(tokens)} tokens")
            lines.extend("    " + ln for ln in _token_table(tokens))
        else:
            lines.append(f"prompts {name}: {len(text)} prompts")
            for t in text:
                lines.append(f"    {ast.quote(t)}: {len(_spell(spec, t))} tokens")
    for run in resolved.runs:
        lines.append("")
        lines.append(format_run_header(run))
        for op in run.ops:
            lines.append("  " + format_op(op, run, resolved))
        for m in run.measures:
            lines.append("  " + format_measure(m, run, spec))
    n_ops = sum(len(r.ops) for r in resolved.runs)
    n_meas = sum(len(r.measures) for r in resolved.runs)
    lines.append("")
    lines.extend(w.render() for w in resolved.warnings)
    n_warn = len(resolved.warnings)
    lines.append(f"ok: {len(resolved.runs)} run{'s' if len(resolved.runs) != 1 else ''}, {n_ops} op"
                 f"{'s' if n_ops != 1 else ''}, {n_meas} measure{'s' if n_meas != 1 else ''}"
                 + (f", {n_warn} warning{'s' if n_warn != 1 else ''}" if n_warn else ""))
    return "\n".join(lines) + "\n"


def format_measure(m: ResolvedMeasure, run: ResolvedRun, spec: ModelSpec) -> str:
    """One measure as `check` prints it, with the token ids it measures."""
    step = "" if m.step is None else f"step {m.step}: "
    extra = ""
    if m.token_ids:
        spelled = spec.tokenizer.convert_ids_to_tokens(list(m.token_ids))
        extra = " -> " + ", ".join(f"token {i} ({s!r})" for i, s in zip(m.token_ids, spelled, strict=True))
    elif m.kind == "norm" and m.position is not None and m.position_var is None:
        extra = f" -> position {m.position}{_token(run, m.position)}"
    return f"{step}measure {m.written}{extra} as {m.result_name}"


def _spell(spec: ModelSpec, text: str) -> tuple[str, ...]:
    """A text's tokens as the tokenizer spells them."""
    return tuple(spec.tokenizer.convert_ids_to_tokens(spec.token_ids(text)))


# ---- CLI handlers ---------------------------------------------------------------


def check_main(args: argparse.Namespace) -> int:
    """`deltalang check FILE | -e TEXT [--prompt P] [--model M]`: print the resolved program, or the errors."""
    try:
        text, filename = read_program(args)
        with warnings.catch_warnings():  # the warnings are part of the output below
            warnings.simplefilter("ignore", DeltaWarning)
            resolved = check(text, getattr(args, "model", None), filename=filename,
                             prompt=getattr(args, "prompt", None),
                             trust_remote_code=getattr(args, "trust_remote_code", False))
        from .plan import build_plan

        try:  # what `run` would refuse while ordering the runs (a cycle, a step a run lacks)
            build_plan(resolved)
        except DeltaError as e:
            raise e.located(text, filename) from None
    except DeltaError as e:
        print(e.render(), file=sys.stderr)
        return 1
    sys.stdout.write(format_resolved(resolved))
    return 0


def fmt_main(args: argparse.Namespace) -> int:
    """`deltalang fmt FILE [-w]`: print the program in canonical form, or rewrite the file."""
    try:
        text, filename = read_program(args)
        program = parse(text, filename)
    except DeltaError as e:
        print(e.render(), file=sys.stderr)
        return 1
    out = ast.format_program(program, text)
    if getattr(args, "write", False):
        if filename.startswith("<"):
            print("error: fmt -w rewrites a file; standard input has none", file=sys.stderr)
            return 1
        if out != text:
            try:
                Path(filename).write_text(out, encoding="utf-8")
            except OSError as e:
                print(f"error: cannot rewrite {filename}: {e.strerror or e}", file=sys.stderr)
                return 1
        return 0
    sys.stdout.write(out)
    return 0
