"""A compiled program: `Experiment` (its plan and emitted code; `run()` executes it -> `Results`).

    exp = Experiment.from_source('read L0.states', model=None, prompt="The Eiffel Tower is in the city of")
    exp.plan, exp.code, exp.run()["main.L0.states"]

`get_model` / `model_for`: the model for a source (the given one, its `model` line, else the bundled
one), loaded once per process; the source is parsed once, or not at all when its caller passes the tree on
(`program=`). The code runs from `linecache` as `<deltalang:FILE>`; a DeltaError it raises is reported against
its op's program line, anything else propagates as deltalang's bug; a DeltaWarning it sends (`measures.unspaced`)
is located at its line's statement. Sweeps run through the `sweep_driver` given (`run.compile` gives the
engine's); without one `run()` refuses them.
"""

from __future__ import annotations

import builtins
import hashlib
import linecache
import traceback
from typing import Any, Callable, Mapping

from deltalang.compiler.emit import emit
from deltalang.compiler.explain import format_plan
from deltalang.compiler.plan import Plan, build_plan
from deltalang.compiler.shown import shown
from deltalang.ground.errors import DeltaError, DeltaWarning, Span, locating
from deltalang.ground.html import ProgressDisplay, progress_bar
from deltalang.language import ast
from deltalang.language.check import check
from deltalang.language.parse import Partial, parse, parse_partial
from deltalang.models.bundled import NAME
from deltalang.runtime.model import DeltaModel, load_model

from .results import Results

_MODELS: dict[tuple, DeltaModel] = {}


def get_model(model: Any = None, *, device: str = "cpu", dtype: Any = None,
              trust_remote_code: bool = False, device_map: str | None = None) -> DeltaModel:
    """A loaded model: `model` itself, or a path / hub id / None (bundled), loaded once per process."""
    if isinstance(model, DeltaModel):
        return model
    key = (str(model) if model is not None else None, device, str(dtype), trust_remote_code, repr(device_map))
    if key not in _MODELS:
        _MODELS[key] = load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                                  device_map=device_map)
    return _MODELS[key]


def model_for(source: str, model: Any, filename: str = "<program>", *, program: ast.Program | None = None,
              **kw: Any) -> DeltaModel:
    """The model a source runs on: `model`, else its `model` line, else the bundled one (`get_model`'s options).

    `program`: `source` already parsed; otherwise it is parsed here, only when `model` is None.
    """
    if model is None:
        if program is None:
            program = parse(source, filename)
        for item in program.items:
            if isinstance(item, ast.ModelDecl):
                model = item.name
    return get_model(model, **kw)


class Experiment:
    """A compiled program: its `plan`, its `code`, and `run()`."""

    def __init__(self, source: str, model: DeltaModel, *, filename: str = "<program>",
                 prompt: str | None = None, batch: bool = True, resolved: Any = None,
                 program: ast.Program | Partial | None = None,
                 sweep_driver: Callable[[Experiment], Results] | None = None) -> None:
        self.source = source
        self.filename = filename
        self.model = model
        self.prompt = prompt
        self.sweep_driver = sweep_driver  # runs a program with sweeps (the sweep engine's driver)
        # `resolved`: the program already checked, maybe rewritten (the sweep engine runs parts of it)
        self.resolved = resolved if resolved is not None else check(source, model.spec, filename=filename,
                                                                    prompt=prompt, program=program)
        try:
            self.plan: Plan = build_plan(self.resolved, batch=batch)
        except DeltaError as e:
            raise e.located(source, filename)
        self.emitted = emit(self.plan, filename=filename, model_id=_model_arg(model))

    @classmethod
    def from_source(cls, source: str, model: Any = None, *, filename: str = "<program>",
                    prompt: str | None = None, batch: bool = True,
                    sweep_driver: Callable[[Experiment], Results] | None = None,
                    program: ast.Program | Partial | None = None, **kw: Any) -> Experiment:
        """Parse (once: `program`, when the caller parsed it), check, plan and emit `source` against
        `model_for(source, model, **kw)`. Syntax errors are raised beside the resolver's errors of the rest (`check`
        raises them all), before the model loads unless a model is given (the resolver's errors need its shape)."""
        parsed = parse_partial(source, filename) if program is None else program
        if isinstance(parsed, Partial) and parsed.errors and model is None:
            check(source, None, filename=filename, prompt=prompt, trust_remote_code=kw.get("trust_remote_code", False),
                  program=parsed)  # raises them
        tree = parsed.program if isinstance(parsed, Partial) else parsed
        return cls(source, model_for(source, model, filename, program=tree, **kw), filename=filename,
                   prompt=prompt, batch=batch, program=parsed, sweep_driver=sweep_driver)

    @property
    def code(self) -> str:
        return self.emitted.code

    def format_plan(self) -> str:
        return format_plan(self.plan)

    @property
    def has_sweeps(self) -> bool:
        return any(r.kind == "sweep" for r in self.resolved.runs)

    @property
    def code_file(self) -> str:
        """The name `code` is saved under: a sweep's code is the reference form the engine does not run."""
        return "reference.py" if self.has_sweeps else "emitted.py"

    def run(self, progress: Any = None) -> Results:
        """Execute the emitted code on the model; sweeps go through the sweep driver (`deltalang.sweep`).

        `progress`: a rich `Console` (a notebook's), or True for one on stderr (the command line), on which a
        program with a generate shows its steps as the model makes them (`StepProgress`); None shows nothing.
        """
        if self.has_sweeps:
            if self.sweep_driver is None:
                raise DeltaError("a program with sweeps runs through the sweep engine: deltalang.run(...), "
                                 "deltalang.compile(...).run() or deltalang.run_sweep(...)")
            return self.sweep_driver(self)
        name = f"<deltalang:{self.filename}:{hashlib.sha1(self.code.encode()).hexdigest()[:8]}>"
        linecache.cache[name] = (len(self.code), None, self.code.splitlines(keepends=True), name)
        namespace: dict[str, Any] = {"__name__": "deltalang_emitted", "__file__": name}
        exec(builtins.compile(self.code, name, "exec"), namespace)
        try:
            with StepProgress(self.model, self.plan, progress), locating(self._warning_locator(name)):
                values = namespace["experiment"](self.model)
        except DeltaError as e:  # the program's mistake, found as it ran: point at its line
            raise self._locate(e, name, e) from None
        return self.results_of(values)

    def results_of(self, values: dict[str, Any], tokens: Mapping[str, tuple[str, ...]] | None = None) -> Results:
        """`values` of this program as Results, with what `Results.summary` needs to show them.

        `tokens`: the tokens of runs the resolved program does not list (a sweep's cells), by run name.
        """
        how = shown(self.plan, tokens)
        return Results(values, model=self.model, program=self.source, code=self.code, kinds=how.kinds,
                       token_labels=how.token_labels, axes=how.axes, code_file=self.code_file)

    def _warning_locator(self, codename: str) -> Callable[[DeltaWarning, str, int], bool]:
        """Locate a warning sent from line `line` of the emitted code at its program statement (and send it on)."""
        def locate(warning: DeltaWarning, file: str, line: int) -> bool:
            if warning.span is None and file == codename and line in self.emitted.line_map:
                warning.span = self.emitted.line_map[line]
                warning.located(self.source, self.filename)
            return False
        return locate

    def _locate(self, err: DeltaError, codename: str, exc: BaseException) -> DeltaError:
        tb = getattr(exc, "__intervention_tb__", None) or exc.__traceback__
        span: Span | None = None
        for frame, lineno in traceback.walk_tb(tb):
            if frame.f_code.co_filename == codename and lineno in self.emitted.line_map:
                span = self.emitted.line_map[lineno]
        if span is not None and err.span is None:
            err.span = span
        return err.located(self.source, self.filename)


class StepProgress(ProgressDisplay):
    """A program with a generate: its forwards counted as the model makes them (a trace's one, a generate's one per
    new token) on `html.progress_bar`'s line, by a forward hook on the model's module, removed on exit."""

    def __init__(self, model: DeltaModel, plan: Plan, console: Any) -> None:
        self.handle: Any = None
        gens = [p.runs[0] for p in plan.passes if p.kind == "generate"]
        module = getattr(model, "_module", None)
        if not gens or not hasattr(module, "register_forward_hook"):
            return
        self.done, self.total = 0, sum(r.max_new_tokens or 1 for r in gens) + sum(p.kind != "generate"
                                                                                 for p in plan.passes)
        self.what = "generate " + ", ".join(r.name for r in gens)
        if console is True:
            from rich.console import Console

            console = Console(stderr=True)
        self.bar, self.task = progress_bar(console, self.total, "steps", self.what)
        self.module = module

    def step(self, *_: Any) -> None:
        self.done += 1
        self.bar.update(self.task, advance=1)

    def __enter__(self) -> StepProgress:
        super().__enter__()
        if self.bar is not None:
            self.handle = self.module.register_forward_hook(self.step)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.remove()
        super().__exit__(*exc)
        if self.handle is not None and isinstance(exc[1], KeyboardInterrupt):  # Ctrl-C: how far it got, one line
            raise KeyboardInterrupt(f"at step {self.done} of {self.total} ({self.what})") from None


def _model_arg(model: DeltaModel) -> str | None:
    return None if model.spec.model_id == NAME else model.spec.model_id
