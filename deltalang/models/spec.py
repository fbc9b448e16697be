"""What a program is checked against: a model's shape, from its config and tokenizer only.

A `ModelSpec` never holds weights, so `deltalang check` is instant on any
checkpoint. It answers: how many blocks, which kind each is, the mixer's
dimensions, whether a value exists on a block (and why not), and how a prompt
tokenizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from deltalang.ground import compat
from deltalang.ground.errors import DeltaModelError

from . import bundled, families, values


@attrs.frozen
class ModelSpec:
    """The config-level facts of a hybrid model."""

    model_id: str
    family: families.Family
    layer_types: tuple[str, ...]
    dims: dict[str, int]
    tokenizer: Any = attrs.field(eq=False, repr=False)
    config: Any = attrs.field(eq=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def kind(self, layer: int) -> str:
        """`deltanet` (a delta-rule mixer), `ssm` (a Mamba-2 one: the family's mechanism says which; a
        granitemoehybrid `linear_attention` block is Mamba-2), `attention` (no recurrent mixer, an attention:
        `full_attention`, `sliding_attention`, ...) or `mlp` (neither: nemotron_h's `mlp` and `moe` blocks)."""
        layer_type = self.layer_types[layer]
        return self.family.layer_kind(layer_type) or (values.ATTENTION if "attention" in layer_type else values.MLP)

    def feed_forward(self, layer: int) -> str:
        """What a block with neither mixer nor attention runs, as shown: `MoE` (nemotron_h's `moe`, a mixture of
        experts) or `MLP`."""
        return "MoE" if self.layer_types[layer] == "moe" else "MLP"

    def linear_layers(self) -> list[int]:
        """The delta-rule blocks (`L[linear]`): never a Mamba-2 block, whatever its config calls it."""
        return self.layers_of(values.DELTANET)

    def ssm_layers(self) -> list[int]:
        """The Mamba-2 blocks (`L[ssm]`)."""
        return self.layers_of(values.SSM)

    def recurrent_layers(self) -> list[int]:
        """The blocks with a recurrent mixer deltalang serves (delta rule or Mamba-2)."""
        return [i for i in range(self.num_layers) if self.kind(i) in values.RECURRENT]

    def attention_layers(self) -> list[int]:
        """The attention blocks (`L[attention]`): never a block with neither a mixer nor attention."""
        return self.layers_of(values.ATTENTION)

    def attention_too(self, layer: int) -> bool:
        """Whether a Mamba-2 block also runs attention (falcon_h1's and zamba2's `hybrid` blocks; zamba2's
        attention is one block shared by all of them)."""
        return self.kind(layer) == values.SSM and self.layer_types[layer] == "hybrid"

    def layers_of(self, kind: str) -> list[int]:
        """The blocks of a selector's kind: `linear` (or `deltanet`), `ssm`, `attention`."""
        kind = values.DELTANET if kind == "linear" else kind
        return [i for i in range(self.num_layers) if self.kind(i) == kind]

    def unavailable(self, layer: int, value: str) -> str | None:
        """Why `value` does not exist on block `layer`, or None if it does."""
        v = values.get(value)
        if v is None:
            return f"no value named {value!r}"
        if not 0 <= layer < self.num_layers:
            return f"no block L{layer}: the model has {self.num_layers} blocks (L0..L{self.num_layers - 1})"
        kind = self.kind(layer)
        if kind not in v.kinds:
            if kind == values.SSM:
                return f"not a value of a Mamba-2 block ({self.layer_types[layer]}: a Mamba-2 mixer)"
            if kind == values.DELTANET:
                return f"a value of Mamba-2 blocks only, not of a DeltaNet block ({self.layer_types[layer]})"
            ssm = values.DELTANET not in v.kinds or self.family.block_kind == values.SSM
            mixer = "Mamba-2" if ssm and values.SSM in v.kinds else "DeltaNet"
            what = f": {'a' if self.feed_forward(layer) == 'MoE' else 'an'} {self.feed_forward(layer)} block, no " \
                "attention either" if kind == values.MLP else ""
            return f"no {mixer} mixer on this block ({self.layer_types[layer]}{what})"
        if value == "gate" and not self.family.gated_norm(text_config(self.config)):
            field = families.ADAPTERS[self.family.name].gate_norm
            return (f"{self.family.name}'s Mamba-2 mixers run no gated norm with this config ({field} is false): "
                    f"a prompt's output is not gated, a decode step's is inside its kernel")
        if value == "output" and self.family.block_output != "tensor":
            return (f"{self.family.name}'s blocks return a {self.family.block_output} (the residual streams and "
                    f"more), not one tensor: read attention_output, or a later block's input")
        return None

    def tokens(self, text: str) -> list[str]:
        """The prompt's tokens as strings, as the model sees them (specials included)."""
        ids = self.tokenizer(text)["input_ids"]
        return [self.tokenizer.decode([i]) for i in ids]

    def token_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])


def _bundled(name_or_path: str | Path | None) -> str | None:
    """The bundled model's name for None or a bundled name (`bundled.MODELS`), unless a directory has that name."""
    if name_or_path is None:
        return bundled.NAME
    name = str(name_or_path)
    return name if name in bundled.MODELS and not Path(name_or_path).exists() else None


def _resolve_path(name_or_path: str | Path | None) -> str:
    name = _bundled(name_or_path)
    if name is not None:
        path = bundled.MODELS[name]
        if not (path / "config.json").exists():
            raise DeltaModelError(
                f"the bundled model {name} is missing from {path}; reinstall deltalang or run "
                f"scripts/train_bundled.py")
        return str(path)
    return str(name_or_path)


def _hub_reachable(timeout: float = 2.0) -> bool:
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False
    finally:
        socket.setdefaulttimeout(old)


def load_config(name_or_path: str | Path | None, trust_remote_code: bool = False) -> tuple[str, Any]:
    """(resolved path or id, config): a local directory, the local HF cache, else the hub."""
    from transformers import AutoConfig

    where = _resolve_path(name_or_path)
    local = Path(where)
    if local.exists() and not local.is_dir():
        raise DeltaModelError(f"cannot load model {where!r}: it is a file, not a checkpoint directory")
    if local.is_dir() and not (local / "config.json").exists():
        raise DeltaModelError(f"cannot load model {where!r}: the directory has no config.json")
    try:
        return where, AutoConfig.from_pretrained(where, local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise DeltaModelError(f"cannot load model {where!r}: {str(e).splitlines()[0]}") from None
    except OSError:
        if local.is_dir():
            raise DeltaModelError(f"cannot load model {where!r}: its config.json does not parse") from None
    if not _hub_reachable():
        raise DeltaModelError(
            f"cannot load model {where!r}: no such local directory, not in the local Hugging Face cache, "
            f"and the hub is unreachable from here; download it where a hub is reachable and pass its "
            f"directory (--model /path/to/checkpoint)")
    try:
        return where, AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DeltaModelError(f"cannot load model {where!r}: {str(e).splitlines()[0]}") from None


def text_config(config: Any) -> Any:
    text = getattr(config, "text_config", None)
    return text if text is not None else config


def spec_from_config(model_id: str, config: Any, tokenizer: Any) -> ModelSpec:
    try:
        fam = families.for_config(config)
    except families.UnservedFamily as e:
        raise DeltaModelError(f"model {model_id!r} has DeltaNet-like layers deltalang cannot serve: {e}") from None
    if fam is None:
        raise DeltaModelError(
            f"model {model_id!r} is a {getattr(config, 'model_type', '?')!r} model, not a supported hybrid; "
            f"deltalang supports {families.supported_names()}")
    tc = text_config(config)
    layer_types = tuple(getattr(tc, "layer_types", None) or ())
    if not layer_types:
        raise DeltaModelError(f"model {model_id!r} has no layer_types in its config")
    try:
        dims = fam.dims(tc)
    except families.UnservedFamily as e:
        raise DeltaModelError(f"model {model_id!r} has DeltaNet-like layers deltalang cannot serve: {e}") from None
    return ModelSpec(model_id, fam, layer_types, dims, tokenizer, config)


# the files a tokenizer is saved as: tokenizers' serialization, its config, a BPE vocabulary, a sentencepiece or
# tiktoken model; a local directory with none of them has no tokenizer (transformers then fails mid-sentence, or
# builds an empty tokenizer of one token from the config alone)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "vocab.txt", "merges.txt", "spiece.model", "special_tokens_map.json")


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES) or \
        any(p.suffix in (".model", ".tiktoken") or p.name.startswith("tokenizer") for p in directory.iterdir())


def load_tokenizer(where: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    if Path(where).is_dir() and not _has_tokenizer_files(Path(where)):
        raise DeltaModelError(
            f"cannot load the tokenizer of {where!r}: the directory has no tokenizer files "
            f"({', '.join(TOKENIZER_FILES[:5])}, ...); copy them from the checkpoint it was saved from, or save them there with "
            f"tokenizer.save_pretrained(DIR)")
    try:
        tok = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DeltaModelError(f"cannot load the tokenizer of {where!r}: {' '.join(str(e).split())}") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_spec(name_or_path: str | Path | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec for a checkpoint, reading only its config and tokenizer (an untested transformers: one line)."""
    compat.check_versions()  # the families are read from transformers' own code
    where, config = load_config(name_or_path, trust_remote_code)
    spec = spec_from_config(_display_id(name_or_path, where), config, None)
    return attrs.evolve(spec, tokenizer=load_tokenizer(where, trust_remote_code))


def _display_id(name_or_path: str | Path | None, where: str) -> str:
    return _bundled(name_or_path) or where
