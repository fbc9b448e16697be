"""Sites: the blocks a selector covers, the values on them, and positions as token indices.

`targets()` turns a site (`L[linear].state_after("Tower")`) into one `Target`
per block, its position resolved in the run's prompt; `expand()` resolves a
selector (a block, `L*`, `L[...]`, a sweep variable); `index()` and `piece()`
resolve a numbered or quoted position; `position_var()` a sweep variable used
as a position. Errors go to the scope; `Fail` abandons the site.
"""

from __future__ import annotations

import difflib
from typing import NoReturn

import attrs

from deltalang.ground import display
from deltalang.ground.errors import Span
from deltalang.models import values
from deltalang.models.spec import ModelSpec

from .. import ast
from ..ir import HEAD_AXIS
from ..tokens import PromptTokens
from .scope import Ctx, Fail, Scope, Target


def targets(scope: Scope, site: ast.Site, ctx: Ctx, *, writing: bool) -> list[Target]:
    """The blocks a site stands for, each with its position resolved in the run's prompt."""
    v = site.value
    verb = "write" if writing else "read"
    if site.head is not None and (site.block is None or v not in HEAD_AXIS):
        what = f"'{v}'" if v in values.CATALOGUE or v in values.MODEL_VALUES else "this site"
        scope.fail(f"{what} has no head axis: .head(h) slices one value head of "
                   f"{', '.join(HEAD_AXIS)}", site.head.span)
    if site.block is None:
        if v in values.MODEL_VALUES:
            if site.position is not None:
                scope.fail(f"'{v}' takes no position", site.position.span)
            if v == "tokens" and ctx.kind != "generate":
                scope.fail("'tokens' are the generated tokens: they exist only under generate", site.span)
            if writing:
                scope.fail(f"'{v}' is read-only: a write targets a block's value, e.g. L0.state_output",
                           site.span)
            return [Target(None, v, None, None, None, v, False, ctx.step)]
        if v in values.CATALOGUE:
            shown = ast.format_site(site)
            scope.fail(f"'{v}' is a value of each block: name the block(s), e.g. L0.{shown} or L*.{shown}",
                       site.span)
        unknown_value(scope, site, block_level=False)
    if v not in values.CATALOGUE:
        if v in values.MODEL_VALUES:
            scope.fail(f"'{v}' is a value of the whole model, not of a block: {verb} {v}", site.span)
        unknown_value(scope, site, block_level=True)
    info = values.CATALOGUE[v]
    if writing and not info.writable:
        hint = "; write state_after(t) for one token's state, or state_output" if v == "states" else ""
        scope.fail(f"'{v}' is read-only{hint}", site.span)
    if info.positional and site.position is None:
        scope.fail(f"'{v}' needs a position: {v}(3), {v}(-1) for the last token, or {v}(\"word\")", site.span)
    if not info.positional and site.position is not None:
        hint = f"; for the state after one token write state_after({ast.format_position(site.position)})" \
            if v == "states" else ""
        scope.fail(f"'{v}' takes no position{hint}", site.position.span)
    if isinstance(site.position, (ast.AllPos, ast.RangePos)):  # one target per position
        return [t for p in several_positions(scope, site.position, ctx)
                for t in targets(scope, attrs.evolve(site, position=p), ctx, writing=writing)]
    assert site.block is not None
    blocks = expand(scope, site.block, v, site.span, ctx)
    position, position_var, step = site_position(scope, site, ctx)
    raw = site.position
    head, head_var = site_head(scope, site, ctx, writing)
    if isinstance(site.block, ast.BlockVar):  # a sweep template: one op, its block bound per point
        return [Target(None, v, position, site.block.name, position_var, ast.format_site(site), False, step,
                       raw, head, head_var)]
    multi = isinstance(site.block, (ast.AllBlocks, ast.BlockList))
    return [Target(b, v, position, None, position_var, ast.format_site(attrs.evolve(site, block=ast.Block(b))),
                   multi, step, raw, head, head_var) for b in blocks]


def site_head(scope: Scope, site: ast.Site, ctx: Ctx, writing: bool) -> tuple[int | None, str | None]:
    """(head, head variable) of `SITE.head(h)`: value heads counted from 0 (negative from the last)."""
    h, v = site.head, site.value
    if h is None:
        return None, None
    if v == "state_input" and not (ctx.kind == "generate" and (ctx.step or 0) > 0):
        scope.fail("state_input is none on a fresh prompt: one head of it exists at a decode step "
                   "(step K: with K >= 1 in a generate)", h.span)
    heads, key_heads = scope.spec.dims["heads"], scope.spec.dims.get("key_heads", scope.spec.dims["heads"])
    if writing and v in ("attention_queries", "attention_keys") and key_heads != heads:
        scope.fail(f"this model has {key_heads} query/key heads, each shared by {heads // key_heads} value heads: "
                   f"a write of one value head's {v} would change the heads that share it; write the whole "
                   f"value (or one head of attention_values, betas, decays or a state)", site.span)
    if isinstance(h, ast.VarPos):
        axis = ctx.axes.get(h.name)
        if h.name in ctx.broken:
            raise Fail  # its axis's error is reported
        if axis is None or axis.kind != "head":
            what = "is not a sweep variable" if axis is None else f"ranges over {axis.kind}s"
            scope.fail(f"'{h.name}' {what}: head(...) takes a head number or a variable over heads "
                       f"(over h in heads)", h.span)
        ctx.used.add(h.name)
        return None, h.name
    if not -heads <= h.value < heads:
        scope.fail(f"no head {h.value}: this model's DeltaNet blocks have {heads} value heads (0..{heads - 1}, "
                   f"or -{heads}..-1 from the last)", h.span)
    return h.value % heads, None


def several_positions(scope: Scope, pos: ast.AllPos | ast.RangePos, ctx: Ctx) -> list[ast.IntPos]:
    """`*` (every position of the prompt) or `A..B` (half-open; a negative number counts from the end, as in
    a sweep's range), as one numbered position each: a donor reads each by the rules of a single one."""
    shown = ast.format_position(pos)
    if ctx.kind == "generate" and (ctx.step or 0) > 0:
        scope.fail(f"at step {ctx.step} the model runs one token; ({shown}) names positions of the prompt, "
                   f"computed at step 0", pos.span)
    if isinstance(pos, ast.AllPos):
        return [ast.IntPos(t, span=pos.span) for t in range(len(ctx.toks))]
    if pos.start >= pos.stop:
        scope.fail(f"the range {shown} is empty: ranges are half-open, {pos.start}..{pos.start + 1} is just "
                   f"{pos.start}; -3..0 is the last three tokens", pos.span)
    seen: dict[int, int] = {}
    for t in range(pos.start, pos.stop):
        p = index(scope, t, ctx.toks, ctx.prompt, pos.span, f"{shown} reaches {t}: ")
        if p in seen:
            scope.fail(f"{shown} names token {p} twice ({seen[p]} and {t}): keep both ends on one side of 0",
                       pos.span)
        seen[p] = t
    return [ast.IntPos(t, span=pos.span) for t in range(pos.start, pos.stop)]


def unknown_value(scope: Scope, site: ast.Site, block_level: bool) -> NoReturn:
    """The error for a value name the catalogue does not know."""
    v = site.value
    if v in values.PYTHON_ONLY:
        scope.fail(f"'{v}' is the Python API's spelling; in a program write states (after every token) "
                   f"or state_after(t)", site.span)
    options = list(values.CATALOGUE) + list(values.MODEL_VALUES)
    guess = difflib.get_close_matches(v, options, n=1, cutoff=0.6)
    hint = f"; did you mean '{guess[0]}'?" if guess else ""
    if not block_level and v in scope.defined:
        kind = scope.defined[v][0]
        scope.fail(f"'{v}' is a {kind}, not a value: a site is BLOCK.VALUE or logits, next_token_probs, tokens",
                   site.span)
    scope.fail(f"no value named '{v}'{hint}", site.span,
               notes=[] if guess else ["values: " + ", ".join(values.CATALOGUE) + "; model-level: "
                                      + ", ".join(values.MODEL_VALUES)])


def site_position(scope: Scope, site: ast.Site, ctx: Ctx) -> tuple[int | None, str | None, int | None]:
    """(position, position variable, step) of a site in its run."""
    pos = site.position
    step = ctx.step
    if pos is None:
        return None, None, step
    if ctx.kind == "generate" and step is None:
        step = 0  # a position lives in the prompt: step 0
    if isinstance(pos, ast.VarPos):
        return None, position_variable(scope, pos, ctx), step
    if ctx.kind == "generate" and step is not None and step > 0:
        return decode_position(scope, pos, ctx, step), None, step
    if isinstance(pos, ast.IntPos):
        return index(scope, pos.value, ctx.toks, ctx.prompt, pos.span), None, step
    return piece(scope, pos, ctx.toks, ctx.prompt), None, step


def decode_position(scope: Scope, pos: ast.Position, ctx: Ctx, step: int) -> int:
    """At generate step k > 0 the model runs one token: new token k, at position n+k-1."""
    here = len(ctx.toks) + step - 1
    if isinstance(pos, ast.IntPos) and pos.value in (-1, here):
        return here
    shown = ast.format_position(pos)
    scope.fail(f"at step {step} the model runs one token (position {here}, or -1); position {shown} "
               f"is not computed at this step", pos.span,
               notes=["positions of the prompt are computed at step 0: write 'step 0: ...'"])


def position_variable(scope: Scope, pos: ast.VarPos, ctx: Ctx) -> str:
    """A position given by a sweep variable: it must range over positions."""
    axis = ctx.axes.get(pos.name)
    if pos.name in ctx.broken:
        raise Fail  # its axis's error is reported
    if axis is None:
        scope.fail(f"unknown position '{pos.name}': a position is a number (3, -1), a quoted piece of the "
                   f"prompt (\"Tower\"), or a sweep variable", pos.span)
    ctx.used.add(pos.name)
    if axis.kind != "position":
        scope.fail(f"'{pos.name}' ranges over {axis.kind}s, not positions: a position variable ranges over "
                   f"numbers (t in 0..9)", pos.span)
    return pos.name


def index(scope: Scope, p: int, toks: PromptTokens, prompt: str, span: Span, prefix: str = "") -> int:
    """A numbered position made non-negative; an error if it is outside the prompt."""
    n = len(toks)
    if -n <= p < n:
        return p % n
    scope.fail(f"{prefix}position {p} is past the end of prompt '{prompt}': it has {n} tokens "
               f"(positions 0..{n - 1}, or -{n}..-1 from the end)", span)


def piece(scope: Scope, pos: ast.PiecePos, toks: PromptTokens, prompt: str) -> int:
    """A quoted piece: the last token of its first occurrence in the prompt."""
    if not pos.text:
        scope.fail("an empty piece names no token: quote a word of the prompt, e.g. \"Tower\"", pos.span)
    found = toks.find(pos.text)
    if found is None:
        notes = []
        low = toks.text.lower().find(pos.text.lower())
        if low >= 0:
            notes.append(f"it occurs as {ast.quote(toks.text[low:low + len(pos.text)])}: pieces match case "
                         "and spaces exactly")
        scope.fail(f"{ast.quote(pos.text)} does not occur in prompt '{prompt}': {ast.quote(toks.text)}",
                   pos.span, notes)
    cut = toks.cut(pos.text)
    if cut:
        parts = " and ".join(f"token {i} ({display.token(toks.decoded[i])})" for i in cut)
        scope.warn(f"{ast.quote(pos.text)} covers only part of {parts} in prompt '{prompt}': it names position "
                   f"{found} ({display.token(toks.decoded[found])}), the whole token", pos.span)
    if found in toks.unknown(scope.unk):
        scope.warn(f"{ast.quote(pos.text)} falls on token {found} of prompt '{prompt}', a word the tokenizer does "
                   f"not know: the model reads {display.token(toks.decoded[found])} there", pos.span)
    return found


def expand(scope: Scope, sel: ast.Selector, value: str | None, span: Span, ctx: Ctx | None = None) -> list[int]:
    """The blocks a selector covers (for a sweep variable: the variable's blocks)."""
    n = scope.spec.num_layers
    blocks_note = f"the model has {n} blocks (L0..L{n - 1})"
    if isinstance(sel, ast.Block):
        if not 0 <= sel.index < n:
            scope.fail(f"no block L{sel.index}: {blocks_note}", sel.span)
        blocks = [sel.index]
    elif isinstance(sel, ast.AllBlocks):
        blocks = [i for i in range(n) if value is None or scope.spec.unavailable(i, value) is None]
        if not blocks:
            scope.fail(f"no block of this model has '{value}'", sel.span)
        return blocks
    elif isinstance(sel, ast.BlockList):
        blocks = bracket(scope, sel, n, blocks_note)
    else:
        blocks = block_var(scope, sel, ctx)
    if value is not None:
        for b in blocks:
            why = scope.spec.unavailable(b, value)
            if why is not None:
                if isinstance(sel, ast.Block):
                    scope.fail(f"L{b} has no value '{value}': {why}", span)
                what = f"'{sel.name}'" if isinstance(sel, ast.BlockVar) else ast.format_selector(sel)
                scope.fail(f"{what} covers L{b}, which has no value '{value}': {why}", span,
                           notes=[f"L[linear] or L* selects only the blocks that have '{value}'"])
    return blocks


def bracket(scope: Scope, sel: ast.BlockList, n: int, blocks_note: str) -> list[int]:
    """The blocks of `L[...]`: the union of its numbers, slices and kinds, in block order."""
    chosen: set[int] = set()
    for item in sel.items:
        if isinstance(item, ast.SelIndex):
            i = item.index + n if item.index < 0 else item.index
            if not 0 <= i < n:
                scope.fail(f"no block {item.index}: {blocks_note}", item.span)
            chosen.add(i)
        elif isinstance(item, ast.SelSlice):
            for end in (item.start, item.stop):
                if end is not None and not -n <= end <= n:
                    scope.fail(f"the slice {ast.format_sel_item(item)} reaches past the last block: {blocks_note}",
                               item.span)
            got = list(range(n))[item.start:item.stop]
            if not got:
                scope.fail(f"the slice {ast.format_sel_item(item)} selects no blocks (slices are half-open)",
                           item.span)
            chosen.update(got)
        else:
            got = scope.spec.layers_of(item.kind)
            if not got:
                scope.fail(f"the model has no {item.kind} blocks; {_kinds_it_has(scope.spec)}", item.span)
            chosen.update(got)
    return sorted(chosen)


def _kinds_it_has(spec: ModelSpec) -> str:
    """The model's recurrent blocks by their selector: `its recurrent blocks are L[ssm] (L0, L2)`."""
    have = [(sel, spec.layers_of(sel)) for sel in ("linear", "ssm")]
    shown = " and ".join(f"L[{sel}] ({', '.join(f'L{i}' for i in got)})" for sel, got in have if got)
    return f"its recurrent blocks are {shown}" if shown else "it has no recurrent blocks"


def block_var(scope: Scope, sel: ast.BlockVar, ctx: Ctx | None) -> list[int]:
    """The blocks of a sweep variable used as a block (`L.state_after(t)`)."""
    axis = ctx.axes.get(sel.name) if ctx is not None else None
    if ctx is not None and sel.name in ctx.broken:
        raise Fail  # its axis's error is reported
    if axis is None:
        if sel.name in scope.defined:
            kind = scope.defined[sel.name][0]
            scope.fail(f"'{sel.name}' is a {kind}, not a block; to take a value from a run write "
                       f"'from {sel.name}.VALUE'", sel.span)
        scope.fail(f"'{sel.name}' is not a block: a block is L3, L*, L[linear], L[0:6] or L[0,2,4]"
                   + (" (or a sweep variable)" if ctx is not None and ctx.kind == "sweep" else ""), sel.span)
    assert ctx is not None
    ctx.used.add(sel.name)
    if axis.kind != "block":
        scope.fail(f"'{sel.name}' ranges over {axis.kind}s, not blocks: a block variable ranges over a selector "
                   f"(L in L[linear])", sel.span)
    return list(axis.values)
