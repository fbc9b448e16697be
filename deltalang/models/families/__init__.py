"""The hybrid families deltalang serves, recognised from the code transformers ships.

A family is a transformers modeling module whose mixer calls a kernel global that
transformers wraps under a hub-kernel name of a known *mechanism* (`MECHANISMS`:
the gated delta rule, KDA, Mamba-2). `analyse(path, module_name)` reads one modeling file
(text and syntax tree only, nothing imported: `code`) and returns its `Family` or None:
the four kernel globals from their decorators, the mixer class from the call in
its `forward`, the attribute paths blocks hold it under from their `__init__`
(`Family.mixer_of(block)` finds it), what a block returns from the model's own call of it,
the model types from the configuration file beside it. `all_families()` does
that for every module of the installed transformers; `for_config(config)` finds
the family of a config (its own model type, a composite's text config, or a
model class registered with transformers' Auto classes). What the code cannot
say lives in one declarative `Adapter` per family (`ADAPTERS`); dims come from
the config's fields named by the mechanism.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import attrs

from . import code

# layer types whose blocks hold a recurrent mixer (a `linear_attention` block of a family that is not a
# delta rule, granitemoehybrid's Mamba-2, is never analysed as one: its module calls no delta-rule kernel)
LINEAR_LAYER_TYPES = ("linear_attention",)
# the kinds of recurrent block, by mechanism (`Mechanism.block_kind`; `values.DELTANET`, `values.SSM`)
DELTANET_KIND, SSM_KIND = "deltanet", "ssm"


def _gdn_dims(config: Any) -> dict[str, int]:
    heads, key_heads = config.linear_num_value_heads, config.linear_num_key_heads
    kd, vd = config.linear_key_head_dim, config.linear_value_head_dim
    return {"heads": heads, "key_heads": key_heads, "key_dim": kd, "value_dim": vd,
            "conv_width": config.linear_conv_kernel_dim, "conv_dim": 2 * key_heads * kd + heads * vd}


def _kda_dims(config: Any) -> dict[str, int]:
    heads, d = config.linear_num_heads, config.linear_head_dim
    return {"heads": heads, "key_heads": heads, "key_dim": d, "value_dim": d,
            "conv_width": config.linear_conv_kernel_dim, "conv_dim": 3 * heads * d}


def _field(config: Any, *names: str) -> int:
    """The first of `names` the config has (the Mamba-2 families name one dim differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    err = AttributeError(names[0])
    err.name = " | ".join(names)
    raise err


def _mamba2_dims(config: Any) -> dict[str, int]:
    """A Mamba-2 mixer's dims: heads of `head_dim` x `d_state` states in `groups` groups of B and C (state
    `[heads, head_dim, d_state]`, so `key_dim` = head_dim, `value_dim` = d_state for the shape-generic code)."""
    heads = _field(config, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
    d_state = _field(config, "mamba_d_state", "ssm_state_size", "state_size")
    groups = _field(config, "mamba_n_groups", "n_groups", "mamba_ngroups")
    width = _field(config, "mamba_d_conv", "conv_kernel")
    try:
        head_dim = _field(config, "mamba_d_head", "mamba_head_dim", "mamba_headdim", "head_dim")
    except AttributeError:  # zamba2: the inner width split over the heads
        head_dim = int(config.mamba_expand * config.hidden_size) // heads
    inner = heads * head_dim
    return {"heads": heads, "key_heads": heads, "key_dim": head_dim, "value_dim": d_state, "head_dim": head_dim,
            "d_state": d_state, "groups": groups, "inner": inner, "conv_width": width,
            "conv_dim": inner + 2 * groups * d_state}


@attrs.frozen
class Mechanism:
    """A kind of recurrent mixer: the hub-kernel names transformers wraps its kernels under."""

    name: str
    chunk_hub: str  # the prompt kernel's hub name
    recurrent_hub: str  # the one-token decode kernel's hub name
    per_channel_decay: bool  # decay per key channel `[b, s, h, dk]` (else per head `[b, s, h]`)
    dims: Callable[[Any], dict[str, int]]  # heads, key_heads, key_dim, value_dim, conv_width, conv_dim
    block_kind: str = DELTANET_KIND  # the kind of block its mixer makes (a selector's `L[linear]`, `L[ssm]`)
    layer_types: tuple[str, ...] = LINEAR_LAYER_TYPES  # the config's layer types of blocks holding its mixer


MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism("gated_delta_rule", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", False, _gdn_dims),
    Mechanism("kda", "chunk_kda", "fused_recurrent_kda", True, _kda_dims),
    # Mamba-2 (SSD): every family's blocks are `linear_attention` (granitemoehybrid, bamba, nemotron_h) or
    # `hybrid` (falcon_h1: Mamba-2 beside attention in every block; zamba2); never a delta rule
    Mechanism("mamba2", "mamba_chunk_scan_combined", "selective_state_update", False, _mamba2_dims, SSM_KIND,
              ("linear_attention", "hybrid", "mamba")),
)
CONV_HUB, CONV_UPDATE_HUB = "causal_conv1d_fn", "causal_conv1d_update"


@attrs.frozen
class Adapter:
    """What a family's code does not say by itself (declarative; one per family at most)."""

    dims: dict[str, str] = attrs.field(factory=dict)  # dim name -> the config field holding it, where it differs
    streams: str | None = None  # config field: residual streams a block's output carries side by side, flattened
    mixer_attr: str | None = None  # the block attribute holding the mixer, where `__init__` builds it indirectly
    unserved: str = ""  # why deltalang cannot serve the family yet (it is then refused in one line)
    gate_norm: str | None = None  # config field: false where a Mamba-2 mixer runs no gated norm (the gate unserved)


# Every dim of the families of transformers 5.24 is read from the mechanism's fields; qwen4_exp's blocks
# carry `hc_count` residual streams flattened into one `[b, s, hc_count * hidden]` tensor; nemotron_h's block
# builds its mixer as `self.mixer = MIXER_TYPES[block_type](...)`, which names no class. (zamba2's nested mixer
# and mamba2's `backbone` are read from the code: `code.mixer_paths`, the model's `base_model_prefix`.)
# falcon_h1 runs its gated norm only where `mamba_rms_norm` is set (false by default: the gate then reaches only
# a decode step's kernel, a prompt's output is not gated).
ADAPTERS: dict[str, Adapter] = {"qwen4_exp": Adapter(streams="hc_count"), "nemotron_h": Adapter(mixer_attr="mixer"),
                                "falcon_h1": Adapter(gate_norm="mamba_rms_norm")}


@attrs.frozen
class Family:
    """A family: one transformers modeling module whose mixer runs a known mechanism."""

    name: str
    module_name: str
    model_types: tuple[str, ...]
    mixer_class: str
    mixer_attr: str  # attribute of a DeltaNet block that holds the mixer
    chunk_kernel: str
    recurrent_kernel: str
    conv_fn: str = "causal_conv1d_fn"
    conv_update: str = "causal_conv1d_update"
    mechanism: str = "gated_delta_rule"
    block_output: str = "tensor"  # what a block's forward returns: "tensor", or "tuple" (glm5_next: + top-k)
    # every attribute path a block holds the mixer under, `mixer_attr` first (zamba2's hybrid blocks: one level
    # down, `mamba_decoder.mamba`)
    mixer_paths: tuple[str, ...] = ()

    def mixer_of(self, block: Any) -> Any:
        """The mixer block `block` holds (a module, or an envoy's), or None: the first of `mixer_paths` there."""
        for path in self.mixer_paths or (self.mixer_attr,):
            found = block
            for part in path.split("."):
                found = getattr(found, part, None)
            module = getattr(found, "_module", found)  # an envoy's module
            if found is not None and isinstance(module, self.mixer_type):
                return found
        return None

    @property
    def per_channel_decay(self) -> bool:
        return mechanism(self.mechanism).per_channel_decay

    @property
    def block_kind(self) -> str:
        """The kind of block its mixer makes: `deltanet` (a delta rule, KDA) or `ssm` (Mamba-2)."""
        return mechanism(self.mechanism).block_kind

    def layer_kind(self, layer_type: str) -> str | None:
        """The recurrent kind of a block of `layer_type` (`block_kind`), None for one without the mixer."""
        return self.block_kind if layer_type in mechanism(self.mechanism).layer_types else None

    @property
    def module(self) -> ModuleType:
        """The transformers modeling module (imported on first use)."""
        return importlib.import_module(self.module_name)

    @property
    def mixer_type(self) -> type:
        return getattr(self.module, self.mixer_class)

    def is_linear_layer(self, config: Any, index: int) -> bool:
        """Whether block `index` holds this family's recurrent mixer (a delta rule's, or a Mamba-2 one)."""
        kinds = getattr(config, "layer_types", None) or []
        return index < len(kinds) and self.layer_kind(kinds[index]) is not None

    def dims(self, config: Any) -> dict[str, int]:
        """Value heads, key_dim, value_dim, key heads and conv width of the mixer, from the config."""
        adapter = ADAPTERS.get(self.name, Adapter())
        if adapter.dims:
            config = _Renamed(config, adapter.dims)
        try:
            return mechanism(self.mechanism).dims(config)
        except AttributeError as e:
            raise UnservedFamily(f"{self.name}: its config has no {e.name!r} field "
                                 f"(a {self.mechanism} mixer's dims are read from it)") from None

    def gated_norm(self, config: Any) -> bool:
        """Whether its Mamba-2 mixers run the gated norm `norm(y, gate)` (falcon_h1: where `mamba_rms_norm`)."""
        field = ADAPTERS.get(self.name, Adapter()).gate_norm
        return field is None or bool(getattr(config, field, True))

    def stream_width(self, config: Any) -> int:
        """The width of a block's output (the residual stream): hidden_size, times its streams."""
        streams = ADAPTERS.get(self.name, Adapter()).streams
        return int(config.hidden_size) * (int(getattr(config, streams)) if streams else 1)

    def __repr__(self) -> str:
        return f"<deltalang family {self.name} ({self.module_name})>"


class UnservedFamily(ValueError):
    """A module with DeltaNet-like layers deltalang cannot serve; the message says what is missing."""


class _Renamed:
    """A config seen through an adapter's field names."""

    def __init__(self, config: Any, names: dict[str, str]) -> None:
        self._config, self._names = config, names

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, self._names.get(name, name))


def mechanism(name: str) -> Mechanism:
    return next(m for m in MECHANISMS if m.name == name)


def _quick_match(text: str) -> bool:
    return any(f'"{m.chunk_hub}"' in text for m in MECHANISMS)


def analyse(path: str | Path, module_name: str, name: str | None = None,
            model_types: tuple[str, ...] | None = None) -> Family | None:
    """The family of one modeling file, None if no mixer of a known mechanism is in it.

    Raises `UnservedFamily` for a module that wraps a mechanism's kernel but whose code does not show
    what deltalang needs (the mixer class, the attribute it sits under, the decode or conv kernels).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if not _quick_match(text):
        return None
    tree = ast.parse(text)
    hubs = code.hub_names(tree)
    mech = next((m for m in MECHANISMS if m.chunk_hub in hubs), None)
    if mech is None:
        return None
    name = name or path.parent.name
    missing = [h for h in (mech.recurrent_hub, CONV_HUB, CONV_UPDATE_HUB) if h not in hubs]
    if missing:
        raise UnservedFamily(f"{name}: its {mech.name} mixer has no kernel wrapped as {', '.join(missing)}")
    chunk = hubs[mech.chunk_hub]
    mixer = code.mixer_class(tree, chunk)
    if mixer is None:
        raise UnservedFamily(f"{name}: no class of {path.name} calls {chunk} in its forward")
    adapter = ADAPTERS.get(name, Adapter())
    if adapter.unserved:
        raise UnservedFamily(f"{name}: {adapter.unserved}")
    paths = code.mixer_paths(tree, mixer) or ((adapter.mixer_attr,) if adapter.mixer_attr is not None else ())
    if not paths:
        raise UnservedFamily(f"{name}: no block of {path.name} holds a {mixer} as an attribute")
    # what the blocks return: as the model's forward takes it, else the holder's annotation
    block_output = code.block_output(tree) or (
        "tuple" if any(code.returns_tuple(tree, c) for c in code.holders(tree, mixer)) else "tensor")
    if model_types is None:
        model_types = code.model_types(path.with_name(path.name.replace("modeling_", "configuration_", 1)))
    return Family(name, module_name, model_types or (name,), mixer, paths[0], chunk, hubs[mech.recurrent_hub],
                  hubs[CONV_HUB], hubs[CONV_UPDATE_HUB], mech.name, block_output, paths)


def _models_root() -> Path | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


@functools.cache
def _analyse_tree(directory: str) -> tuple[tuple[Family, ...], tuple[str, ...]]:
    """(the families of every modeling module under transformers/models, why each unserved one is not)."""
    root = _models_root()
    found: list[Family] = []
    unserved: list[str] = []
    if root is None:
        return (), ()
    for path in sorted(root.glob(f"{directory}/modeling_*.py")):
        module_name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            fam = analyse(path, module_name)
        except (UnservedFamily, SyntaxError, OSError, UnicodeDecodeError) as e:
            unserved.append(str(e))
            continue
        if fam is not None:
            found.append(fam)
    return tuple(found), tuple(unserved)


def all_families() -> tuple[Family, ...]:
    """Every family of the installed transformers (read from its code once per process)."""
    return _analyse_tree("*")[0]


def unserved() -> tuple[str, ...]:
    """Why each module that wraps a mechanism's kernel cannot be served (one line each)."""
    return _analyse_tree("*")[1]


def _in_tree(model_type: str) -> Family | None:
    """The family whose module serves `model_type`, reading that module only."""
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name
        directory = model_type_to_module_name(model_type)
    except Exception:  # an older transformers without the helper: read them all
        directory = "*"
    if not directory.replace("_", "").isalnum() and directory != "*":
        return None
    found, problems = _analyse_tree(directory)
    for fam in found:
        if model_type in fam.model_types:
            return fam
    if problems and directory != "*":
        raise UnservedFamily(problems[0])
    return None


_REGISTERED: dict[str, Family] = {}


def _registered(config: Any) -> Family | None:
    """The family of a model class registered with transformers' Auto classes outside its tree."""
    key = getattr(config, "model_type", None)
    if key in _REGISTERED:
        return _REGISTERED[key]
    try:
        from transformers import AutoModelForCausalLM
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # not registered for a causal LM (or an older mapping API)
        return None
    module = inspect.getmodule(cls)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return None
    fam = analyse(path, module.__name__, name=str(key), model_types=(str(key),))
    if fam is not None:
        _REGISTERED[str(key)] = fam
    return fam


def for_config(config: Any) -> Family | None:
    """The family of a config (a text config or a composite one), or None.

    Raises `UnservedFamily` when the config's modeling module wraps a mechanism's kernel that deltalang
    cannot serve (the message says what is missing)."""
    seen = []
    c = config
    while c is not None and all(c is not s for s in seen):
        seen.append(c)
        model_type = getattr(c, "model_type", None)
        if isinstance(model_type, str) and model_type:
            fam = _in_tree(model_type) or _registered(c)
            if fam is not None:
                return fam
        c = getattr(c, "text_config", None)
    return None


def auto_class(config: Any) -> Any:
    """The transformers Auto class that builds a model of `config`: a causal LM where transformers has one
    for it, else an image-text-to-text model (glm5_next: no text-only class), whose text stack serves."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            if type(config) in auto._model_mapping:
                return auto
        except Exception:  # a mapping that cannot import one of its classes
            continue
    return AutoModelForCausalLM


def by_name(name: str) -> Family:
    for fam in (*all_families(), *_REGISTERED.values()):
        if name == fam.name or name in fam.model_types:
            return fam
    raise KeyError(name)


def supported_names() -> str:
    return ", ".join(f.name for f in all_families())


def resolve(family: Family | ModuleType | str) -> Family:
    """Accept a Family, its modeling module, or a name."""
    if isinstance(family, Family):
        return family
    if isinstance(family, str):
        try:
            return by_name(family)
        except KeyError:
            pass
    if isinstance(family, ModuleType):
        for fam in (*all_families(), *_REGISTERED.values()):
            if family.__name__ == fam.module_name:
                return fam
    raise ValueError(f"not a deltalang family: {family!r}; supported: {supported_names()}")


def __getattr__(name: str) -> Any:
    """`families.qwen3_5`, `families.kimi_linear`, ... (and `families.ALL`): looked up in the code found."""
    if name == "ALL":
        return all_families()
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return by_name(name)
    except KeyError:
        raise AttributeError(f"module 'deltalang.models.families' has no attribute {name!r}") from None
