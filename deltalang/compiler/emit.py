"""Plan -> the nnsight program a researcher would write by hand: `emit()`.

One `with model.trace(...)` (or `model.generate(...)`) per pass, one `tracer.invoke(...)` per run sharing
it, every op on its own line in forward order with a comment naming its `.dl` line. The code defines
`experiment(model) -> dict` and, run as a script, loads the model and prints the results. Sweeps compile
to their reference form (a forward per cell, as `deltalang sweep --naive` runs them), and the docstring
says so. `Emitted.line_map` maps each generated line to its `.dl` span, for runtime errors.
"""

from __future__ import annotations

from typing import Any

import attrs

from deltalang.ground import display, measures
from deltalang.ground.errors import DeltaPlanError, Span
from deltalang.ground.version import __version__
from deltalang.language.ir import (HEAD_AXIS, Arith, Const, Donor, FromRun, Load, Mean, MeanDirection, Named, Scale,
                                   Steer, Zeros, expr_atoms)

from .plan import HIDDEN, STATES_AS_RUN, Pass, Plan, PlanOp, RunPlan
from .shown import Shown, shown

INDENT = "    "


@attrs.frozen
class Emitted:
    code: str
    line_map: dict[int, Span]


class _Writer:
    def __init__(self, filename: str) -> None:
        self.lines: list[str] = []
        self.map: dict[int, Span] = {}
        self.filename = filename

    def add(self, depth: int, text: str, span: Span | None = None, note: str = "") -> None:
        comment = ""
        if span is not None:
            comment = f"  # {self.filename}:{span.line}" + (f" {note}" if note else "")
        elif note:
            comment = f"  # {note}"
        self.lines.append(INDENT * depth + text + comment)
        if span is not None:
            self.map[len(self.lines)] = span

    def blank(self) -> None:
        self.lines.append("")


def mixer(layer: int) -> str:
    return f"model.layers[{layer}].linear_attn"


def _tail(tail: int | None) -> str:
    """A left-padded run's own positions of a model-level per-token value: its last `tail`."""
    return "" if tail is None else f"[:, -{tail}:]"


def head_index(value: str, head: int | None) -> str:
    """`[:, 3]` or `[:, :, 3]`: one value head's slice of a value (its head axis is `HEAD_AXIS[value]`)."""
    return "" if head is None else "[" + ":, " * HEAD_AXIS.get(value, 2) + f"{head}]"  # states_as_run: 2


def call_position(op: PlanOp) -> int | None:
    """The position as the kernel call counts it: the prompt's own at step 0; at a decode step the call runs
    one token (the program's position n+k-1), its last: -1."""
    return -1 if (op.step or 0) > 0 and op.position is not None else op.position


def read_expr(op: PlanOp, tracer: str = "tracer", tail: int | None = None) -> str:
    """The expression that reads `op`'s site inside a trace (`tail`: the run's tokens, if it is padded)."""
    if op.reduce is not None:  # computed in the forward; `states` by the value layer, a group of chunks at a time
        whole = attrs.evolve(op, reduce=None, head=None)  # `.head(h)` is the reduction's first step
        red = reduction_expr(op.reduce)
        if op.value == "states":
            return f"{mixer(op.layer)}.states_reduced({red})"  # type: ignore[arg-type]
        return f"{red}({read_expr(whole, tracer, tail)})"
    if op.head is not None:
        return read_expr(attrs.evolve(op, head=None), tracer, tail) + head_index(op.value, op.head)
    if op.layer is None:
        if op.value == "tokens":
            return f"{tracer}.result"
        return f"model.{op.value}" + (_tail(tail) if op.value == "logits" else "")
    if op.value == "output":
        return f"model.layers[{op.layer}].output{_tail(tail)}"
    m = mixer(op.layer)
    if op.value in ("state_after", "conv_window_after"):
        return f"{m}.{op.value}({call_position(op)})"
    if op.value == STATES_AS_RUN:
        return f"{m}.states_as_run"
    return f"{m}.{op.value}"


def reduction_expr(red: Any) -> str:
    """`measures.Reduction(AXES, [("norm", ("key_dim",))])`: an `ir.Reduce` as the code that runs it."""
    steps = ", ".join(f"({k!r}, {direction_expr(a)})" if k == "project" else f"({k!r}, {a!r})"
                      for k, a in red.steps)
    return f"measures.Reduction({red.axes!r}, [{steps}])"


def direction_expr(d: Any) -> str:
    """A projection's direction: a loaded tensor, or arithmetic over means computed in earlier passes
    (`results[...] - results[...]`, one head's slice after `.head(h)`)."""
    if isinstance(d, Load):
        return f"loaded[{loaded_key(d)!r}]"
    assert isinstance(d, MeanDirection), d

    def expr(e: Any, outer: int = 0, right: bool = False) -> str:
        if isinstance(e, Arith):
            prec = 2 if e.op == "*" else 1
            text = f"{expr(e.left, prec)} {e.op} {expr(e.right, prec, True)}"
            return f"({text})" if prec < outer or (right and prec == outer) else text
        return repr(e.value) if isinstance(e, Const) else f"results[{e.key!r}]"

    return f"({expr(d.expr)})" + ("" if d.head is None else head_index(*d.head))


def write_stmt(op: PlanOp, value: str, tail: int | None = None) -> str:
    """The statement that writes `value` to `op`'s site (`tail`: the run's tokens, if it is padded)."""
    if op.value == "output":
        if tail is not None:  # in place: the padded positions keep what they hold
            return f"model.layers[{op.layer}].output{_tail(tail)} = {value}"
        return f"model.layers[{op.layer}].output = {value}"
    m = mixer(op.layer)  # type: ignore[arg-type]
    if op.value in ("state_after", "conv_window_after"):
        return f"{m}.set_{op.value}({call_position(op)}, {value})"
    return f"{m}.{op.value} = {value}"


def source_expr(op: PlanOp, tail: int | None = None) -> str:
    src = op.source
    if isinstance(src, Zeros):
        return f"torch.zeros_like({read_expr(op, tail=tail)})"
    if isinstance(src, Scale):
        return f"{read_expr(op, tail=tail)} * {src.factor!r}"
    if isinstance(src, (FromRun, Named, Mean)):
        return f"results[{op.donor_key!r}]"
    if isinstance(src, (Steer, Load)):
        value = operand_expr(src.expr if isinstance(src, Steer) else src, op, tail)
        if isinstance(src, Steer) and src.add:  # `+=`: added to the value the forward computed
            return f"{read_expr(op, tail=tail)} + " + (f"({value})" if isinstance(src.expr, Arith) else value)
        return value
    raise AssertionError(f"unknown write source {src!r}")


def loaded_key(src: Load) -> str:
    """Where the emitted code keeps a loaded tensor: `direction.safetensors:key`."""
    return f"{src.shown}:{src.key}"


def operand_expr(e: Any, op: PlanOp, tail: int | None, outer: int = 0, right: bool = False) -> str:
    """An operand of a write's arithmetic as Python: `results[...]` for a value from elsewhere, a loaded
    tensor cast to the written value's dtype and device and shaped as it, zeros, a number, `a - b`."""
    if isinstance(e, Arith):
        prec = 2 if e.op == "*" else 1
        text = f"{operand_expr(e.left, op, tail, prec)} {e.op} {operand_expr(e.right, op, tail, prec, True)}"
        return f"({text})" if prec < outer or (right and prec == outer) else text
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Donor):
        return f"results[{e.key!r}]"
    if isinstance(e, Zeros):
        return f"torch.zeros_like({read_expr(op, tail=tail)})"
    if isinstance(e, Load):
        site = read_expr(op, tail=tail)
        return f"loaded[{loaded_key(e)!r}].to({site}).reshape({site}.shape)"
    raise AssertionError(f"unknown operand {e!r}")


def emit_loads(w: _Writer, plan: Plan) -> None:
    """`loaded = {...}`: the program's `load(...)` tensors, read once by safetensors (no pickle, no code)."""
    loads: dict[str, Load] = {}
    for p in plan.passes:
        for r in p.runs:
            for op in r.ops:
                src = op.source
                for a in (expr_atoms(src.expr) if isinstance(src, Steer) else [src]) + (
                        op.reduce.loads() if op.reduce is not None else []):
                    if isinstance(a, Load):
                        loads.setdefault(loaded_key(a), a)
    if not loads:
        return
    w.add(1, "loaded = {  # load(...): safetensors files, relative to the program")
    for key, a in loads.items():
        w.add(2, f"{key!r}: safetensors.torch.load_file({a.path!r})[{a.key!r}],")
    w.add(1, "}")


def head_operand_expr(e: Any, op: PlanOp, part: str, outer: int = 0, right: bool = False) -> str:
    """An operand of a write of one head: a value from elsewhere (read whole) at that head, zeros of the head's
    shape, a number; a `load(...)` is refused (its shape is the whole value's or one head's)."""
    if isinstance(e, Arith):
        prec = 2 if e.op == "*" else 1
        text = f"{head_operand_expr(e.left, op, part, prec)} {e.op} {head_operand_expr(e.right, op, part, prec, True)}"
        return f"({text})" if prec < outer or (right and prec == outer) else text
    if isinstance(e, Donor):
        return f"results[{e.key!r}]" + head_index(op.value, op.head)
    if isinstance(e, Zeros):
        return f"torch.zeros_like({part})"
    if isinstance(e, Load):
        raise DeltaPlanError(f"{op.text}: load(...) in a write of one head is not supported; write the whole value "
                             f"with a direction of its shape", op.span)
    return operand_expr(e, op, None)


def emit_head_write(w: _Writer, op: PlanOp, depth: int, note: str) -> None:
    """A write of one head: the whole value, that head's slice replaced, written back (the others unchanged)."""
    whole = attrs.evolve(op, head=None)
    part = "_whole" + head_index(op.value, op.head)
    src = op.source
    if isinstance(src, Zeros):
        value = f"torch.zeros_like({part})"
    elif isinstance(src, Scale):
        value = f"{part} * {src.factor!r}"
    elif isinstance(src, FromRun):  # the donor's whole value was read: take its head
        value = f"results[{op.donor_key!r}]" + head_index(src.value, src.head)
    elif isinstance(src, Mean):
        value = f"results[{op.donor_key!r}]" + head_index(op.value, op.head)
    elif isinstance(src, Steer):  # arithmetic: `+= 2`, `+= mean(P)`, `= 2 * other.SITE`, each operand at that head
        value = head_operand_expr(src.expr, op, part)
        value = f"{part} + ({value})" if src.add else value
    else:
        raise AssertionError(f"a write of one head from {src!r}")
    w.add(depth, f"_whole = {read_expr(whole)}.clone()", op.span, note)
    w.add(depth, f"{part} = {value}", op.span, f"head {op.head} only")
    w.add(depth, write_stmt(whole, "_whole"), op.span)


def _token_note(run: RunPlan, op: PlanOp, tokens: dict[str, tuple[str, ...]]) -> str:
    toks = tokens.get(run.name, ())
    if op.position is not None and op.position < len(toks) and op.value in ("state_after", "conv_window_after"):
        return f"token {op.position} = {display.token(toks[op.position])}"
    return ""


def emit_ops(w: _Writer, run: RunPlan, ops: list[PlanOp], depth: int,
             tokens: dict[str, tuple[str, ...]], tail: int | None = None) -> None:
    for op in ops:
        note = _token_note(run, op, tokens)
        if op.kind == "read":
            if op.value == "tokens":
                continue  # read after the generate loop
            w.add(depth, f"results[{op.key!r}] = {read_expr(op, tail=tail)}.save()", op.span, note)
        elif op.head is not None:
            emit_head_write(w, op, depth, note)
        else:
            w.add(depth, write_stmt(op, source_expr(op, tail), tail), op.span, note)


def emit_run_body(w: _Writer, run: RunPlan, depth: int, tokens: dict[str, tuple[str, ...]],
                  tail: int | None = None) -> None:
    if run.kind != "generate":
        emit_ops(w, run, list(run.ops), depth, tokens, tail)
        if not run.ops:
            w.add(depth, "pass")
        return
    by_step: dict[int, list[PlanOp]] = {}  # one pass over the ops: a generate may have a step per new token
    for op in run.ops:
        if op.value != "tokens":
            by_step.setdefault(op.step or 0, []).append(op)
    steps = sorted(by_step)
    if steps:
        sel = f"{steps[0]}" if len(steps) == 1 else f"[{', '.join(map(str, steps))}]"
        w.add(depth, f"for step in tracer.iter[{sel}]:")
        for k in steps:
            ops = by_step[k]
            if len(steps) == 1:
                emit_ops(w, run, ops, depth + 1, tokens)
            else:
                w.add(depth + 1, f"if step == {k}:")
                emit_ops(w, run, ops, depth + 2, tokens)
    for op in run.ops:
        if op.value == "tokens":
            n = len(tokens.get(run.name, ()))
            w.add(depth, f"results[{op.key!r}] = tracer.result[:, {n}:].save()", op.span, "the new tokens")
    if not run.ops:
        w.add(depth, "pass")


def _prompt_ref(run: RunPlan, prompts: dict[str, str]) -> str:
    if run.token_ids:  # teacher forcing: the prompt's tokens and the answer's but its last
        return repr(list(run.token_ids))
    return f"PROMPTS[{run.prompt!r}]" if run.prompt in prompts else repr(run.prompt_text)


def _keep(p: Pass) -> str:
    """`, logits_to_keep=K`: the last positions whose logits the pass's measures need (the LM head is
    applied to those only; every value is the same), unless a run reads `logits` itself."""
    keep = 1
    for r in p.runs:
        for op in r.ops:
            if op.value == "logits":
                if not op.hidden:
                    return ""
                keep = max(keep, r.answer_len)
    return f", logits_to_keep={keep}"


def emit_pass(w: _Writer, p: Pass, prompts: dict[str, str], tokens: dict[str, tuple[str, ...]]) -> None:
    names = ", ".join(r.name + (" (implicit)" if r.implicit else "") for r in p.runs)
    w.add(1, f"# pass {p.index}: {names}")
    depth = 1
    if p.route:
        w.add(1, f"with deltalang.routed(model.family, {p.route!r}):")
        depth = 2
    if p.kind == "generate":
        run = p.runs[0]
        n = run.max_new_tokens
        s = run.sampling
        how = "do_sample=False"
        if s is not None:  # the tempered, top-p distribution itself: no top-k cut (transformers' default 50)
            how = f"do_sample=True, temperature={s.temperature or 1.0!r}, top_p={s.top_p or 1.0!r}, top_k=0"
            if s.seed is not None:
                w.add(depth, f"torch.manual_seed({s.seed})", note="the seed: the same tokens on every run")
        if len(p.runs) > 1:  # runs of one length (a generate over a dataset): an invoke each, rows in order
            emit_shared_generate(w, p, depth, f"max_new_tokens={n}, min_new_tokens={n}, {how}", prompts, tokens)
            return
        w.add(depth, f"with torch.no_grad(), model.generate({_prompt_ref(run, prompts)}, max_new_tokens={n}, "
                     f"min_new_tokens={n}, {how}) as tracer:")
        emit_run_body(w, run, depth + 1, tokens)
    elif len(p.runs) == 1:
        run = p.runs[0]
        w.add(depth, f"with torch.no_grad(), model.trace({_prompt_ref(run, prompts)}{_keep(p)}):")
        emit_run_body(w, run, depth + 1, tokens)
    else:
        w.add(depth, f"with torch.no_grad(), model.trace({_keep(p)[2:]}) as tracer:")
        longest = max(r.n_tokens for r in p.runs)
        for run in p.runs:
            pad = longest - run.n_tokens
            w.add(depth + 1, f"with tracer.invoke({_prompt_ref(run, prompts)}):",
                  note=run.name + (f" ({run.n_tokens} tokens, {pad} padding)" if p.padded else ""))
            emit_run_body(w, run, depth + 2, tokens, run.n_tokens if pad else None)


def emit_shared_generate(w: _Writer, p: Pass, depth: int, options: str, prompts: dict[str, str],
                         tokens: dict[str, tuple[str, ...]]) -> None:
    """Generates of one prompt length sharing one `model.generate`: an invoke per run (its steps' ops), then
    an empty invoke saving every row's tokens; run i's new tokens are row i past its prompt."""
    w.add(depth, f"with torch.no_grad(), model.generate({options}) as tracer:")
    for run in p.runs:
        w.add(depth + 1, f"with tracer.invoke({_prompt_ref(run, prompts)}):", note=run.name)
        emit_run_body(w, attrs.evolve(run, ops=tuple(op for op in run.ops if op.value != "tokens")), depth + 2,
                      tokens)
    key = f"{HIDDEN}pass{p.index}.tokens"
    w.add(depth + 1, "with tracer.invoke():", note="every run's tokens, a row each")
    w.add(depth + 2, f"results[{key!r}] = tracer.result.save()")
    for i, run in enumerate(p.runs):
        for op in run.ops:
            if op.value == "tokens":
                w.add(depth, f"results[{op.key!r}] = results[{key!r}][{i}:{i + 1}, {run.n_tokens}:]", op.span,
                      f"{run.name}'s new tokens")


def emit_main(w: _Writer, how: Shown) -> None:
    """What a run of the script prints: `deltalang run`'s summary of the results (`Results.summary`), told what
    each result holds, the axes of a reduction or one head, a per-token norm's tokens (`shown`); empty ones left out."""
    notes = {"KINDS": ("kinds", how.untold_kinds(), "what a result holds where its name does not say it: how "
                                                 "`deltalang run` prints it (Results.summary)"),
             "AXES": ("axes", how.axes, "the axes of a reduction or of one head"),
             "TOKENS": ("token_labels", how.token_labels, "the tokens of a per-token norm: its rows")}
    passed = []
    for name, (keyword, items, note) in notes.items():
        if not items:
            continue
        passed.append(f"{keyword}={name}")
        w.add(0, f"{name} = {{", note=note)
        for k, v in items.items():
            w.add(1, f"{k!r}: {v!r},")
        w.add(0, "}")
    if passed:
        w.blank()
        w.blank()
    w.add(0, 'if __name__ == "__main__":')
    w.add(1, "model = deltalang.load_model(MODEL)")
    if not passed:
        w.add(1, "print(deltalang.Results(experiment(model), model=model).summary())")
        return
    w.add(1, f"results = deltalang.Results({', '.join(['experiment(model)', 'model=model', *passed])})")
    w.add(1, "print(results.summary())")


def emit(plan: Plan, *, filename: str = "<program>", model_id: str | None = None) -> Emitted:
    """The plan as a Python module defining `experiment(model) -> dict[str, Tensor | float]`."""
    resolved = plan.resolved
    w = _Writer(filename.rsplit("/", 1)[-1])
    prompts = {k: v for k, v in resolved.prompts.items() if isinstance(v, str)}
    tokens = {r.name: r.tokens for r in resolved.runs}
    for r in resolved.runs:
        if r.kind == "sweep":
            for point in r.points():
                tokens[r.instantiate(point).name] = r.tokens
    sweeps = [r.name for r in resolved.runs if r.kind == "sweep"]
    if sweeps:  # the sweep commands run an engine, not this code: say so first
        w.add(0, f'"""The reference form of sweep(s) {", ".join(sweeps)}: one full forward per cell, compiled by '
                 f'deltalang {__version__}')
        w.add(0, f"from {filename}.")
        w.add(0, "")
        w.add(0, "`deltalang sweep` and `deltalang run` do not run this code: their sweep engine computes the same")
        w.add(0, "cells by recomputing only the blocks and positions each cell's writes change, and falls back to")
        w.add(0, "this form (a few cells per forward) for a sweep it cannot serve. `deltalang sweep --naive` runs")
        w.add(0, "every sweep in this form: the reference the engine is checked against. (--normalise is computed")
        w.add(0, "by the command, not here.)")
    else:
        w.add(0, f'"""nnsight code compiled by deltalang {__version__} from {filename}.')
    w.add(0, "")
    w.add(0, "Ops are in the order the forward reaches them; each comment names its program line.")
    w.add(0, "Run it as a script, or call experiment(model) on a deltalang.load_model(...) model.")
    w.add(0, '"""')
    w.add(0, "import torch")
    w.add(0, "")
    w.add(0, "import deltalang")
    w.add(0, "from deltalang import measures")
    if any(isinstance(a, Load) for p in plan.passes for r in p.runs for op in r.ops
           for a in (expr_atoms(op.source.expr) if isinstance(op.source, Steer) else [op.source])
           + (op.reduce.loads() if op.reduce is not None else [])):
        w.add(0, "import safetensors.torch")
    w.add(0, "")
    w.add(0, f"MODEL = {model_id!r}  # None: the bundled model")
    w.add(0, "PROMPTS = {")
    for name, text in prompts.items():
        w.add(1, f"{name!r}: {text!r},")
    w.add(0, "}")
    w.blank()
    w.blank()
    w.add(0, "def experiment(model):")
    w.add(1, "results = {}")
    emit_loads(w, plan)
    for p in plan.passes:
        emit_pass(w, p, prompts, tokens)
        for c in p.then:
            inputs = ", ".join(f"results[{k!r}]" for k in c.inputs)
            w.add(1, f"results[{c.key!r}] = torch.stack([{inputs}]).mean(dim=0)")
    for run, m in plan.measures:
        keys = plan.inputs[m.result_name]  # the run's own input, then (kl) the other run's logits
        reference = f"results[{keys[1]!r}]" if m.kind == "kl" else None
        if m.at is not None:  # `at POS`: the logits of that position, counted from the run's last
            own = {r.name: len(r.token_ids) for r in resolved.runs}
            reference = reference and f"{reference}[:, {(m.against_at or 0) - own.get(m.against or '', 0)}]"
            args = [f"results[{keys[0]!r}][:, {m.at - own[run]}]",
                    *map(str, measures.arguments(m.kind, m.token_ids, reference))]
        else:
            args = [f"results[{keys[0]!r}]", *map(str, measures.arguments(m.kind, m.token_ids, reference))]
        if m.reduce is not None:  # computed in the forward: the value is the measure
            args = [f"results[{keys[0]!r}]"]
        if m.forced:  # each answer's every token, then (logit_diff) the logits of the second answer's run
            args = [f"results[{keys[0]!r}]", *map(str, m.answers)] + [f"results[{k!r}]" for k in keys[1:]]
        fn = "reduced" if m.reduce is not None else m.kind
        w.add(1, f"results[{m.result_name!r}] = measures.{fn}({', '.join(args)})", m.span,
              "teacher forcing: sum of log-probabilities" if m.forced else "")
        for text, token, twin in zip(m.token_texts, m.token_ids, m.spaced):
            if twin is not None and not m.forced:  # an answer without its leading space: warn if its twin is far likelier
                w.add(1, f"measures.unspaced({args[0]}, {text!r}, {token}, {twin}, {m.result_name!r})", m.span,
                      f"{display.token(' ' + text)} is token {twin}")
    w.add(1, f"return {{k: v for k, v in results.items() if not k.startswith({HIDDEN!r})}}")
    w.blank()
    w.blank()
    emit_main(w, shown(plan, tokens))
    return Emitted("\n".join(w.lines) + "\n", w.map)
