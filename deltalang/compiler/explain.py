"""What `deltalang check` and `deltalang emit --plan` print: `format_resolved()`, `format_plan()`.

`format_resolved()` prints a resolved program the way `deltalang check` shows it:
the model, every prompt's tokens, every run, every op in source order, and what
every position resolved to, with the token there (`L0.state_after("Tower") ->
position 2 (␣Tower)`: tokens shown as tables show them, `display.token`). Counting tokens by hand is the slip researchers make
most; this is where they see the count. An answer written without its leading space
whose spaced twin is another token gets a note (the run warns when the twin is far likelier).
The resolver's warnings are part of it, rendered like errors, before its last line.

`format_plan()` prints a plan: its passes, the runs (invokes) of each, each op
in forward order, and where each written value comes from in the results.

A write's source is spelled by `deltalang.language.ir.format_source` for both. Layer 4:
reads `ir`, `plan`, `ast`, `spec`; prints, decides nothing.
"""

from __future__ import annotations

from typing import Sequence

from deltalang.ground import display
from deltalang.ground.measures import UNSPACED_FACTOR
from deltalang.language import ast
from deltalang.language.ir import Resolved, ResolvedMeasure, ResolvedOp, ResolvedRun, format_source, token_note
from deltalang.language.tokens import decoded
from deltalang.models.spec import ModelSpec

from .plan import STATES_AS_RUN, Plan, PlanOp

# ---- a resolved program (`deltalang check`) ---------------------------------------


def describe_model(spec: ModelSpec) -> str:
    """`NAME: qwen3_5, 4 blocks (DeltaNet L0 L1 L2; attention L3)`; a Mamba-2 model names its Mamba-2 blocks
    (`Mamba-2 L0 L1 L2, L1 L2 with attention too; attention none`), and blocks with neither (`MLP L1`, `MoE L3`)."""
    def blocks(layers: list[int]) -> str:
        return " ".join(f"L{i}" for i in layers) or "none"
    if spec.family.block_kind == "ssm":
        both = [i for i in spec.ssm_layers() if spec.attention_too(i)]
        rec = f"Mamba-2 {blocks(spec.ssm_layers())}" + (f", {blocks(both)} with attention too" if both else "")
    else:
        rec = f"DeltaNet {blocks(spec.linear_layers())}"
    rest = "".join(f"; {name} {blocks(got)}" for name in ("MLP", "MoE")
                   if (got := [i for i in spec.layers_of("mlp") if spec.feed_forward(i) == name]))
    return f"{spec.model_id}: {spec.family.name}, {spec.num_layers} blocks ({rec}; attention " \
           f"{blocks(spec.attention_layers())}{rest})"


def _token_table(tokens: tuple[str, ...], width: int = 96) -> list[str]:
    """`0 The  1 ␣Eiffel  2 ␣Tower ...` (`display.token`), wrapped."""
    lines: list[str] = []
    cur = ""
    for i, t in enumerate(tokens):
        cell = f"{i} {display.token(t)}"
        if cur and len(cur) + 2 + len(cell) > width:
            lines.append(cur)
            cur = cell
        else:
            cur = f"{cur}  {cell}" if cur else cell
    if cur:
        lines.append(cur)
    return lines


def _position_note(position: int | None, position_var: str | None, tokens: tuple[str, ...]) -> str:
    """` -> position 15 (r)` for a resolved position, else nothing."""
    if position_var is not None or position is None:
        return ""
    return f" -> position {position}{token_note(tokens, position)}"


def format_op(op: ResolvedOp, run: ResolvedRun, resolved: Resolved) -> str:
    """One op as `check` prints it."""
    step = "" if op.step is None else f"step {op.step}: "
    where = _position_note(op.position, op.position_var, run.tokens)
    if op.kind == "read":
        shape = "" if op.reduce is None else f", shape {op.reduce.shown()}"
        return f"{step}read {op.written}{where} as {op.result_name}{shape}"
    return f"{step}write {op.written}{where} {format_source(op.source, resolved.runs)}"


def format_run_header(run: ResolvedRun) -> str:
    """`trace NAME on PROMPT (N tokens)`, with max_new_tokens, route, and a sweep's axes resolved."""
    n = len(run.token_ids)
    head = f"{run.kind} {run.name} on {run.prompt} ({n} token{'s' if n != 1 else ''})"
    if run.max_new_tokens is not None:
        head += f", max_new_tokens {run.max_new_tokens}" + (
            f", sampling:{ast.format_sampling(run.sampling)}" if run.sampling is not None else "")
    if run.route is not None:
        head += f", route {run.route}"
    if run.implicit:
        why = "the statements outside any block" if run.name == "main" else "a clean run, named in from/kl"
        head += f"  [implicit: {why}]"
    for a in run.axes:
        if a.kind == "block":
            head += f"\n  over {a.var} in " + " ".join(f"L{b}" for b in a.values)
        elif a.kind == "head":
            head += f"\n  over {a.var} in heads " + " ".join(map(str, a.values))
        else:
            cells = " ".join(f"{p}{token_note(run.tokens, p)}" for p in a.values)
            contiguous = list(a.labels) == list(range(a.labels[0], a.labels[0] + len(a.labels)))
            written = f"{a.labels[0]}..{a.labels[-1] + 1}" if contiguous else ", ".join(map(str, a.labels))
            head += f"\n  over {a.var} in {written}: positions {cells}"
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
    if m.forced:
        extra = " -> " + ", ".join(f"tokens {list(a)} ({' '.join(_shown(spec, a))})"
                                   for a in m.answers) + " (teacher forcing: sum of log-probabilities)"
    elif m.token_ids and m.kind != "top":
        extra = " -> " + ", ".join(f"token {i} ({s})" for i, s in zip(m.token_ids, _shown(spec, m.token_ids),
                                                                       strict=True))
    elif m.kind == "norm" and m.position is not None and m.position_var is None:
        extra = f" -> position {m.position}{token_note(run.tokens, m.position)}"
    if m.at is not None:  # `measure ... at POS`: the logits of that position
        extra += f", the logits of position {m.at}{token_note(run.tokens, m.at)}"
    shape = "" if m.reduce is None else f", shape {m.reduce.shown()}"
    return f"{step}measure {m.written}{extra} as {m.result_name}{shape}" + "".join(
        f"\n    note: {_unspaced_note(spec, text, twin)}" for text, twin in zip(m.token_texts, m.spaced) if twin is not None)


def _unspaced_note(spec: ModelSpec, text: str, twin: int) -> str:
    """What check says of an answer written without its leading space whose spaced twin is one other token."""
    return (f"{ast.quote(text)} has no leading space; the word after a space is token {twin} "
            f"({_shown(spec, [twin])[0]}), another token: the run warns if it is {UNSPACED_FACTOR:g} times as likely")


def _shown(spec: ModelSpec, ids: Sequence[int]) -> tuple[str, ...]:
    """Tokens as messages and tables show them (`display.token`: ␣Tower)."""
    return tuple(display.token(t) for t in decoded(spec.tokenizer, ids))


def _spell(spec: ModelSpec, text: str) -> tuple[str, ...]:
    """A text's tokens, each decoded alone (`format_resolved` shows them through `display.token`)."""
    return decoded(spec.tokenizer, spec.token_ids(text))


# ---- a plan (`deltalang emit --plan`) ---------------------------------------------


def site(op: PlanOp) -> str:
    text = op.value if op.position is None else f"{op.value}({op.position})"
    if op.reduce is not None:  # computed in the forward: the steps, `states` a group of chunks at a time
        text += "".join(f".{k}({_reduce_arg(k, a)})" for k, a in op.reduce.steps)
    if op.value == STATES_AS_RUN:
        text = "states (as the written forward ran)"
    where = "" if op.layer is None else f"L{op.layer}."
    step = "" if op.step is None else f"step {op.step}: "
    return f"{step}{where}{text}"


def _reduce_arg(kind: str, arg: object) -> str:
    if kind == "project":  # a file, or means (`mean(a) - mean(b)`)
        return f"load({getattr(arg, 'shown', '')!r})" if hasattr(arg, "path") else getattr(arg, "shown", "")
    if kind in ("head", "svd", "rank"):  # a number: the head, how many singular values, the tolerance
        return repr(arg)
    return "" if arg is None else ", ".join(arg)  # type: ignore[call-overload]


def describe_source(op: PlanOp) -> str:
    """A planned write's source: `= zeros`, `*= 0.5`, or the result its value is read from (`= ~base.L0...`)."""
    return format_source(op.source, donor_key=op.donor_key, number="{:g}".format)


def format_plan(plan: Plan) -> str:
    """The plan as text: passes, their runs (invokes), each op in forward order."""
    lines = []
    for p in plan.passes:
        what = "generate" if p.kind == "generate" else "trace"
        route = f", route {p.route}" if p.route else ""
        longest = max(r.n_tokens for r in p.runs)
        padded = f", left-padded to {longest} tokens" if p.padded else ""
        lines.append(f"pass {p.index}: one {what}, {len(p.runs)} invoke(s){route}{padded}")
        if p.apart:
            lines.append(f"  ({p.apart})")
        for r in p.runs:
            extra = f", max_new_tokens {r.max_new_tokens}" if r.kind == "generate" else ""
            if r.sampling is not None:
                extra += f", sampling:{ast.format_sampling(r.sampling)}"
            if p.padded:
                extra += f" ({r.n_tokens} tokens)"
            why = f"  (implicit: {r.why or 'a clean run for ' + r.name})" if r.implicit else ""
            lines.append(f"  {r.name} on {r.prompt_text!r}{extra}{why}")
            for op in r.ops:
                if op.kind == "read":
                    lines.append(f"    read  {site(op):40} -> {op.key}")
                else:
                    lines.append(f"    write {site(op):40} {describe_source(op)}")
        for c in p.then:
            lines.append(f"  then {c.key} = mean of {len(c.inputs)} reads")
    for run, m in plan.measures:
        lines.append(f"measure {m.result_name}")
    return "\n".join(lines) + "\n"
