"""What a model serves on this process: its blocks, their kernels, and which values each serves.

Reads a `ModelSpec` (no weights) and the kernel routing (`deltalang.runtime.kernels`):
`status` says whether block i serves a value, or why not (the block's kind, or a
compiled kernel without Python source); `served_by` names what computes a value
(the torch reference, or FLA's kernel on CUDA tensors where FLA is installed:
`deltalang.runtime.backends`); `support_table` is `DeltaModel.support()` (with
`kernels=True`, each available entry names what serves it); `format_info` is the
table `deltalang info` prints. `kernel_notes` is what the kernels' names leave out,
one line each (`backends.note`): a package installed but not bound, with its import
error, or FLA's handoff to FlashQLA, which deltalang turns off for its calls; `info`
prints them and `support(kernels=True)` appends them to what serves a kernel's value.
"""

from __future__ import annotations

from deltalang.models import values
from deltalang.models.spec import ModelSpec

from . import backends, kernels

AVAILABLE = "available"


def kernel_names(spec: ModelSpec) -> tuple[str, str]:
    """What a prompt and a decode step run through on this process, in words."""
    fam = spec.family
    compiled = kernels.compiled_kernels(fam)
    route = kernels.current_route(fam)
    if fam.chunk_kernel in compiled:
        prompt = f"compiled ({compiled[fam.chunk_kernel]})"
    elif route == "torch":
        prompt = "pure-torch token-by-token"
    else:
        prompt = _named(kernels.backend(fam, fam.chunk_kernel), "pure-torch chunked")
    decode = (f"compiled ({compiled[fam.recurrent_kernel]})" if fam.recurrent_kernel in compiled
              else _named(kernels.backend(fam, fam.recurrent_kernel), "pure-torch token-by-token"))
    return prompt, decode


def kernel_notes(spec: ModelSpec) -> list[str]:
    """One line per thing the kernels' names leave out (`backends.note`), each once."""
    fam = spec.family
    out: list[str] = []
    for name in (fam.chunk_kernel, fam.recurrent_kernel, fam.conv_fn, fam.conv_update):
        line = backends.note(kernels.backend(fam, name))
        if line and line not in out:
            out.append(line)
    return out


def _named(impl: backends.Backend, torch_words: str) -> str:
    """A kernel in words: `torch_words` for the torch reference, else the implementation and where it runs."""
    words = impl.describe()
    return torch_words if words == "torch reference" else words.replace("torch reference", torch_words)


def served_by(spec: ModelSpec, name: str, notes: bool = True) -> str:
    """What computes value `name` of a DeltaNet block on this process, in words (`notes`: with `kernel_notes`)."""
    fam = spec.family
    v = values.CATALOGUE[name]
    if name in ("states", "states_as_run"):
        if fam.block_kind == values.SSM:
            return "deltalang's chunked Mamba-2 scan (deltalang.runtime.ssd; torch, any device)"
        return "deltalang's chunked delta rule (torch, any device)"
    if name.startswith("conv_window"):
        words = "convolution: " + kernels.backend(fam, fam.conv_fn).describe()
        return _noted(words, fam.conv_fn, spec) if notes else words
    if not v.kernel:
        return "the model's forward"
    if kernels.current_route(fam) == "torch":
        return "deltalang's token-by-token delta rule (route torch)"
    prompt = kernels.backend(fam, fam.chunk_kernel).describe()
    decode = kernels.backend(fam, fam.recurrent_kernel).describe()
    words = f"prompt: {prompt}; decode step: {decode}" if prompt != decode else prompt
    return _noted(_noted(words, fam.chunk_kernel, spec), fam.recurrent_kernel, spec) if notes else words


def _noted(words: str, kernel: str, spec: ModelSpec) -> str:
    """`words` with the kernel's note, if it has one not already there (`backends.note`)."""
    line = backends.note(kernels.backend(spec.family, kernel))
    return f"{words} ({line})" if line and line not in words else words


def status(spec: ModelSpec, layer: int, name: str) -> str:
    """`available`, or why block `layer` does not serve value `name`."""
    why = spec.unavailable(layer, name)
    if why is not None:
        return why
    v = values.CATALOGUE[name]
    fam = spec.family
    compiled = kernels.compiled_kernels(fam)
    needed: list[str] = []
    if name == "conv_window_after":
        needed = [fam.conv_fn]
    elif v.kernel and kernels.current_route(fam) != "torch":
        needed = [fam.chunk_kernel]
    for kernel in needed:
        if kernel in compiled:
            return kernels.compiled_message(fam, kernel)
    return AVAILABLE


def support_table(spec: ModelSpec, kernels: bool = False) -> dict[str, list[str]]:
    """`{"linear_attn.<value>": [status per block], "output": [...]}`.

    With `kernels=True` an available entry reads `available: <what serves it>` (`served_by`).
    """
    table: dict[str, list[str]] = {}
    for name, v in values.CATALOGUE.items():
        key = name if name == "output" else f"linear_attn.{name}"
        row = [status(spec, i, name) for i in range(spec.num_layers)]
        if kernels:
            how = served_by(spec, name)
            row = [f"{AVAILABLE}: {how}" if st == AVAILABLE else st for st in row]
        table[key] = row
    return table


def format_info(spec: ModelSpec) -> str:
    """The table `deltalang info` prints."""
    from rich.console import Console
    from rich.table import Table

    prompt, decode = kernel_names(spec)
    d = spec.dims
    ssm = spec.family.block_kind == values.SSM
    count = f"{len(spec.ssm_layers())} Mamba-2" if ssm else f"{len(spec.linear_layers())} DeltaNet"
    head = Table(title=f"{spec.model_id}  ({spec.family.name}, {spec.num_layers} blocks, {count})"
                       + ("; a Mamba-2 state is heads x head_dim x d_state" if ssm else ""), show_lines=False)
    # a state's two axes as reductions name them (`values.axes`): key_dim, value_dim; a Mamba-2 one's head_dim, d_state
    state_axes = values.axes("state_output", kind=spec.family.block_kind)[-2:]  # type: ignore[index]
    for col in ("block", "kind", "family", "heads", *state_axes, "conv", "prompt kernel", "decode kernel"):
        head.add_column(col)
    for i in range(spec.num_layers):
        if spec.kind(i) in values.RECURRENT:
            kind = "DeltaNet" if spec.kind(i) == values.DELTANET else (
                "Mamba-2 + attention" if spec.attention_too(i) else "Mamba-2")
            head.add_row(f"L{i}", kind, spec.family.name, str(d["heads"]), *(str(d[a]) for a in state_axes),
                         str(d["conv_width"]), prompt, decode)
        else:
            head.add_row(f"L{i}", spec.feed_forward(i) if spec.kind(i) == values.MLP else "attention", spec.family.name,
                         "", "", "", "", "", "")
    vals = Table(title="values per block (✓ available)")
    vals.add_column("value")
    for i in range(spec.num_layers):
        vals.add_column(f"L{i}", justify="center")
    reasons: dict[str, str] = {}
    for name in values.CATALOGUE:
        row = []
        for i in range(spec.num_layers):
            st = status(spec, i, name)
            if st == AVAILABLE:
                row.append("✓")
            else:
                mark = reasons.setdefault(st, f"[{len(reasons) + 1}]")
                row.append(mark)
        vals.add_row(name, *row)
    console = Console(width=200, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(head)
        console.print(vals)
        for reason, mark in reasons.items():
            console.print(f"{mark} {reason}")
        console.print("model values: " + ", ".join(values.MODEL_VALUES))
        for line in kernel_notes(spec):
            console.print(f"kernels: {line}", soft_wrap=True)
        if spec.recurrent_layers():
            console.print("served by (CUDA tensors go to a compiled kernel where one is installed, "
                          "others to the torch reference):")
            kinds = {spec.kind(i) for i in range(spec.num_layers)}
            for name, v in values.CATALOGUE.items():
                if name not in values.MODEL_VALUES and kinds & set(v.kinds):
                    console.print(f"  {name}: {served_by(spec, name, notes=False)}")
    return cap.get()
