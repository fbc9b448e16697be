"""What a model serves on this process: its blocks, their kernels, and which values each serves.

Reads a `ModelSpec` (no weights) and the kernel routing (`deltalang.kernels`):
`status` says whether block i serves a value, or why not (the block's kind, or a
compiled kernel without Python source); `support_table` is `DeltaModel.support()`;
`format_info` is the table `deltalang info` prints.
"""

from __future__ import annotations

from . import kernels, values
from .spec import ModelSpec

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
        prompt = "pure-torch chunked"
    decode = (f"compiled ({compiled[fam.recurrent_kernel]})" if fam.recurrent_kernel in compiled
              else "pure-torch token-by-token")
    return prompt, decode


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


def support_table(spec: ModelSpec) -> dict[str, list[str]]:
    """`{"linear_attn.<value>": [status per block], "output": [...]}`."""
    table: dict[str, list[str]] = {}
    for name, v in values.CATALOGUE.items():
        key = name if name == "output" else f"linear_attn.{name}"
        table[key] = [status(spec, i, name) for i in range(spec.num_layers)]
    return table


def format_info(spec: ModelSpec) -> str:
    """The table `deltalang info` prints."""
    from rich.console import Console
    from rich.table import Table

    prompt, decode = kernel_names(spec)
    d = spec.dims
    head = Table(title=f"{spec.model_id}  ({spec.family.name}, {spec.num_layers} blocks, "
                       f"{len(spec.linear_layers())} DeltaNet)", show_lines=False)
    for col in ("block", "kind", "family", "heads", "key_dim", "value_dim", "conv", "prompt kernel",
                "decode kernel"):
        head.add_column(col)
    for i in range(spec.num_layers):
        if spec.kind(i) == values.DELTANET:
            head.add_row(f"L{i}", "DeltaNet", spec.family.name, str(d["heads"]), str(d["key_dim"]),
                         str(d["value_dim"]), str(d["conv_width"]), prompt, decode)
        else:
            head.add_row(f"L{i}", "attention", spec.family.name, "", "", "", "", "", "")
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
    return cap.get()
