"""The resolver's first pass: the model line, prompts, runs and the names reads define, into the scope.

`declare(scope)` enters every name once (a second definition is an error naming
the first), checks each prompt's tokens (empty: an error; words the tokenizer
does not know: a warning), chooses the prompt of the implicit run `main`, and
records the `as NAME` of every read and measure so later uses (forward ones
too) find them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from deltalang.ground import display
from deltalang.ground.errors import Span

from .. import ast
from .scope import Alias, Scope, n_tokens


def _same_model(declared: str, used: str) -> bool:
    """Whether a program's `model "ID"` names the model it is checked against (an id, or the same directory)."""
    if declared == used:
        return True
    a, b = Path(declared), Path(used)
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def declare(scope: Scope) -> None:
    """First pass: the model, prompts, runs, and the names reads define."""
    for item in scope.program.items:
        if isinstance(item, ast.ModelDecl):
            if scope.model is not None:
                scope.error("a program names its model once", item.span)
            else:
                scope.model_span = item.span
            scope.model = item.name
        elif isinstance(item, ast.PromptDecl):
            if scope.define(item.name, "prompt", item.span):
                scope.prompts[item.name] = item
                scope.prompt_texts[item.name] = item.text
        elif isinstance(item, ast.PromptListDecl):
            if scope.define(item.name, "prompt list", item.span):
                scope.prompts[item.name] = item
                scope.prompt_texts[item.name] = item.texts
        elif isinstance(item, ast.RUN_TYPES):
            if scope.define(item.name, item.__class__.__name__.lower(), item.span):
                scope.runs[item.name] = item
        elif isinstance(item, ast.Route):
            if scope.global_route is not None and scope.global_route != item.kernel:
                scope.error(f"the program already routes '{scope.global_route}'", item.span)
            scope.global_route = item.kernel
        else:
            scope.main_items.append(item)
    if not scope.main_items and not any(isinstance(item, ast.RUN_TYPES) for item in scope.program.items):
        scope.error("nothing to run: the program has no trace, generate or sweep, and no statement outside "
                    "them", Span(1, 1, 1, 1))
    if scope.model is not None and scope.model_span is not None and not _same_model(scope.model,
                                                                                   scope.spec.model_id):
        scope.warn(f"the program names model {ast.quote(scope.model)}, but the caller's model is used: "
                   f"{scope.spec.model_id} (--model or model=); this line is ignored", scope.model_span)
    for name, p in scope.prompts.items():
        if isinstance(p, ast.PromptDecl):
            unknown_words(scope, p.text, f"prompt '{name}'", p.span)
        else:
            for text in p.texts:
                unknown_words(scope, text, f"prompt {ast.quote(text)} of '{name}'", p.span)
    if scope.main_items:
        choose_main_prompt(scope)
    for item in scope.program.items:
        if isinstance(item, ast.RUN_TYPES):
            declare_aliases(scope, item.name, item.body, isinstance(item, ast.Sweep))
    declare_aliases(scope, "main", scope.main_items, False)


def choose_main_prompt(scope: Scope) -> None:
    """The implicit run `main`: on --prompt, else the prompt `main`, else the first prompt."""
    first = scope.main_items[0]
    if "main" in scope.runs:
        scope.error("a run is named 'main', and the statements outside any block form the run 'main' too",
                    scope.runs["main"].span)
    elif "main" not in scope.defined:
        scope.defined["main"] = ("run", first.span)
    if scope.override is not None:  # --prompt: the prompt `main`, replacing a declared one
        span = scope.prompts["main"].span if "main" in scope.prompts else first.span
        scope.prompts["main"] = ast.PromptDecl("main", scope.override, span=span)
        scope.prompt_texts["main"] = scope.override
        scope.main_prompt = "main"
        unknown_words(scope, scope.override, f"the prompt of 'main' (--prompt or prompt=) {ast.quote(scope.override)}",
                      None)
        return
    if isinstance(scope.prompts.get("main"), ast.PromptDecl):
        scope.main_prompt = "main"
        return
    single = [p.name for p in scope.prompts.values() if isinstance(p, ast.PromptDecl)]
    if len(single) == 1:
        scope.main_prompt = single[0]
        return
    if single:
        scope.error(f"statements outside a run form the implicit trace 'main', which needs one prompt; this "
                    f"program declares {len(single)}: {', '.join(single)}; put them in "
                    f"'trace NAME on PROMPT {{ ... }}', name one prompt 'main', or pass --prompt TEXT", first.span)
        return
    scope.error("statements outside a block run on a prompt, and there is none: pass --prompt TEXT "
                "or declare one (prompt main = \"...\")", first.span)


def declare_aliases(scope: Scope, run: str, body: Sequence[ast.Statement], in_sweep: bool) -> None:
    """Enter the names `read ... as NAME` and `measure ... as NAME` define (forward uses are fine)."""
    for st in body:
        inner = st.body if isinstance(st, ast.Step) else st
        if isinstance(inner, (ast.Read, ast.Measure)) and inner.alias is not None:
            kind = "read" if isinstance(inner, ast.Read) else "measure"
            if inner.alias == "zeros":
                scope.error("'zeros' is reserved ('= zeros'); name the result something else", inner.span)
            elif scope.define(inner.alias, kind, inner.span):
                scope.aliases[inner.alias] = Alias(run, kind, inner.span, in_sweep=in_sweep)


def unknown_words(scope: Scope, text: str, what: str, span: Span | None) -> None:
    """An error for a prompt of no tokens; a warning when the tokenizer can read words of it only as
    its unknown token: how many, which."""
    toks = scope.tokens(text)
    if len(toks) == 0:
        scope.error(f"{what} is empty: a run needs at least one token", span or Span(1, 1, 1, 1))
        return
    if scope.unk is None:
        return
    unknown = toks.unknown(scope.unk)
    if not unknown:
        return
    words = list(dict.fromkeys(toks.text[slice(*toks.offsets[i])].strip() or toks.decoded[i] for i in unknown))
    shown = ", ".join(ast.quote(w) for w in words[:8]) + (", ..." if len(words) > 8 else "")
    scope.warn(f"{what}: {len(unknown)} of {n_tokens(len(toks))} are unknown to this model's tokenizer, "
               f"so the model reads {display.token(scope.spec.tokenizer.unk_token)} in their place: {shown}", span)
