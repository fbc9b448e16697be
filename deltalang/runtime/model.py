"""Loading a hybrid checkpoint as an nnsight model that serves the DeltaNet values.

`load_model()` opens the bundled model, `load_model(path_or_id)` any checkpoint of a recognised family
(`families`); `wrap_model(hf)` wraps a loaded one. The result is an nnsight `LanguageModel` with
`.layers[i].linear_attn` (every family's mixer under one name, its values from `mixer.DeltaNetEnvoy`),
`.logits` and `.next_token_probs` inside a trace, `.family`, `.spec`, `.support()`. A model may be wrapped
any number of times and every wrapper works; the kernel dispatchers are installed once per family and
process. `decoder(hf)` / `decoder_layers(hf)` are the one place that finds the decoder stack and its blocks (under
the model's `base_model_prefix`: mamba2's `backbone`); `Family.mixer_of` finds a block's mixer (zamba2: nested).
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import attrs
import torch

from deltalang.ground import compat
from deltalang.ground.errors import DeltaModelError
from deltalang.ground.quiet import quiet_transformers
from deltalang.models import families, values

from . import kernels
from .deltarule import reusing
from .info import support_table
from .kernels import unwinding

try:
    from nnsight import LanguageModel

    from .mixer import DeltaNetEnvoy, MixerSite
except ImportError:  # an nnsight (or transformers) outside the supported range: one line naming it
    compat.check_versions()
    raise
from deltalang.models.spec import ModelSpec, _display_id, load_config, load_tokenizer, spec_from_config

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise DeltaModelError(f"unknown dtype {dtype!r}; one of {', '.join(_DTYPES)}") from None


class DeltaModel(LanguageModel):
    """An nnsight LanguageModel over a gated-DeltaNet hybrid, with deltalang's values."""

    spec: ModelSpec
    family: families.Family

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """nnsight's driver of a trace, leaving the stack of running mixers as it found it.

        Inside it, the blocks' `states` may reuse one buffer (`deltalang.runtime.deltarule.reusing`)."""
        with unwinding(), reusing():
            return super().interleave(fn, *args, **kwargs)

    @property
    def device(self) -> torch.device | None:
        """Where a trace's inputs go: the first parameter not on `meta` (accelerate leaves the weights
        it offloads to disk there between calls, and its hooks move inputs to each module's device)."""
        return next((p.device for p in self._module.parameters() if p.device.type != "meta"), None)

    @property
    def layers(self) -> Any:
        """The decoder blocks (an envoy list), wherever the architecture keeps them."""
        return decoder_layers(self)

    @property
    def logits(self) -> torch.Tensor:
        """The model's logits, [b, s, vocab] (inside a trace): the forward's own `.logits`, after any step
        the family takes past the LM head (granitemoehybrid divides by `logits_scaling`, falcon_h1
        multiplies by `lm_head_multiplier`, nemotron_h and mamba2 cast to float32)."""
        return self.output.logits

    @property
    def next_token_probs(self) -> torch.Tensor:
        """The distribution over the next token after each prompt, [b, vocab] (inside a trace)."""
        return self.logits[:, -1].float().softmax(dim=-1)

    def linear_layers(self) -> list[int]:
        return self.spec.linear_layers()

    def support(self, layer: int | None = None, kernels: bool = False) -> dict[str, Any]:
        """Which values each block serves: `"available"` or the reason it is not.

        `support()` maps `"linear_attn.states"` etc. to a list over blocks;
        `support(layer=i)` to block i's entry; `kernels=True` names what serves each
        available value (`"available: fla chunk_gated_delta_rule (compiled) on CUDA, ..."`).
        """
        table = support_table(self.spec, kernels=kernels)
        if layer is None:
            return table
        if not 0 <= layer < self.spec.num_layers:
            raise DeltaModelError(f"no block L{layer}: the model has {self.spec.num_layers} blocks")
        return {key: per_layer[layer] for key, per_layer in table.items()}


def load_model(name_or_path: str | Path | None = None, device: str = "cpu",
               dtype: str | torch.dtype | None = None, *, trust_remote_code: bool = False,
               device_map: str | dict[str, Any] | None = None, offload_folder: str | Path | None = None,
               verbose: bool = False) -> DeltaModel:
    """Load a hybrid checkpoint: None = the bundled model, a local directory, or a hub id.

    As quiet as the command line (`quiet.quiet_transformers`: no progress bars, no kernel fall-back
    notices) unless `verbose`.

    `device_map` shards it through accelerate: `"auto"` (or another name accelerate knows), a dict
    from module names to devices (`"cpu"`, `"disk"`, `0`, `"cuda:1"`), or the path of a JSON file
    holding such a dict (or `{"device_map": {...}, "offload_folder": DIR}`, DIR relative to the
    file). Modules placed on `"disk"` are offloaded to `offload_folder` (default: a temporary
    directory removed at exit).
    """
    compat.check_versions()
    if not verbose:
        quiet_transformers()
    where, config = load_config(name_or_path, trust_remote_code)
    spec = spec_from_config(_display_id(name_or_path, where), config, None)  # refused before any weight is read
    kernels.install(spec.family)
    tokenizer = load_tokenizer(where, trust_remote_code)

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = parse_dtype(dtype)
    if device_map is not None:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise DeltaModelError("--device-map needs accelerate: pip install accelerate") from None
        kwargs["device_map"], folder = device_map_of(device_map, offload_folder)
        if folder is not None:
            kwargs["offload_folder"] = str(folder)
    try:
        hf = families.auto_class(config).from_pretrained(where, **kwargs)
    except (OSError, ValueError) as e:
        raise DeltaModelError(f"cannot load the weights of {where!r}: {str(e).splitlines()[0]}") from None
    if device_map is None:
        hf = hf.to(device)
    return _wrap(hf, tokenizer, attrs.evolve(spec, config=hf.config))


def device_map_of(device_map: str | dict[str, Any] | Path,
                  offload_folder: str | Path | None = None) -> tuple[str | dict[str, Any], str | Path | None]:
    """The device map accelerate gets and the offload folder, from a name, a dict or a JSON file's path."""
    if isinstance(device_map, Path) or (isinstance(device_map, str) and device_map.endswith(".json")):
        where = Path(device_map)
        try:
            data = json.loads(where.read_text())
        except (OSError, ValueError) as e:
            raise DeltaModelError(f"cannot read the device map {str(where)!r}: {str(e).splitlines()[0]}") from None
        if isinstance(data, dict) and isinstance(data.get("device_map"), dict):
            if offload_folder is None and data.get("offload_folder") is not None:
                offload_folder = where.parent / str(data["offload_folder"])
            data = data["device_map"]
        device_map = data
    if isinstance(device_map, dict):
        bad = [k for k, v in device_map.items() if not isinstance(k, str) or not isinstance(v, (str, int))]
        if bad or not device_map:
            raise DeltaModelError(f"a device map maps module names to devices ('cpu', 'disk', 0, 'cuda:1'); "
                                  f"got {device_map!r:.120}")
        if "disk" in device_map.values() and offload_folder is None:
            offload_folder = tempfile.mkdtemp(prefix="deltalang-offload-")
            atexit.register(shutil.rmtree, offload_folder, True)
    elif not isinstance(device_map, str):
        raise DeltaModelError(f"a device map is a name ('auto'), a dict or a JSON file; got {type(device_map).__name__}")
    return device_map, offload_folder


def wrap_model(hf: torch.nn.Module, tokenizer: Any, model_id: str | None = None) -> DeltaModel:
    """Wrap an in-memory transformers model of a supported family (what `load_model` returns)."""
    compat.check_versions()
    model_id = model_id or getattr(hf.config, "_name_or_path", None) or type(hf).__name__
    spec = spec_from_config(model_id, hf.config, tokenizer)
    kernels.install(spec.family)
    return _wrap(hf, tokenizer, spec)


def _wrap(hf: torch.nn.Module, tokenizer: Any, spec: ModelSpec) -> DeltaModel:
    """The wrapper of `hf`, whose spec is built and whose family's kernels are installed."""
    fam = spec.family
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    hf.eval()
    sites = _attach_sites(hf, spec)
    # every block's mixer as `linear_attn`: a block's own child by its class, a nested one by its path
    rename: dict[Any, str] | None = {fam.mixer_type: "linear_attn"} if fam.mixer_attr != "linear_attn" else None
    for path in fam.mixer_paths[1:]:
        rename = (rename or {}) | {path: "linear_attn"}
    with _pipeline_safe(hf), _quiet_pipeline():
        model = DeltaModel(hf, tokenizer=tokenizer, envoys={fam.mixer_type: DeltaNetEnvoy}, rename=rename)
    model.spec = attrs.evolve(spec, tokenizer=tokenizer)
    model.family = fam
    for layer, site in sites.items():
        envoy = model.layers[layer].linear_attn
        site.bind(model.interleaver, envoy.path)
    return model


@contextmanager
def _quiet_pipeline() -> Iterator[None]:
    """transformers' pipeline (which nnsight builds) logs an error listing every causal LM for a model that is
    not one (glm5_next's image-text-to-text class, whose text stack deltalang serves): silenced while wrapping."""
    log = logging.getLogger("transformers.pipelines.base")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextmanager
def _pipeline_safe(hf: torch.nn.Module) -> Iterator[None]:
    """transformers' pipeline (which nnsight builds) takes the first device of `hf_device_map` as its
    own, failing on `"disk"`, and moves a model without one to its device, failing on the weights
    accelerate offloaded to `meta` (`cpu_offload`): for the wrapping only, a map whose first device
    is a real one."""
    device_map = getattr(hf, "hf_device_map", None)
    if isinstance(device_map, dict) and device_map:
        if next(iter(device_map.values())) != "disk":
            yield
            return
        main: Any = next((v for v in device_map.values() if v != "disk"), "cpu")
    elif any(p.device.type == "meta" for p in hf.parameters()):
        main = getattr(getattr(hf, "_hf_hook", None), "execution_device", None) or "cpu"
    else:
        yield
        return
    hf.hf_device_map = {"": main, **(device_map or {})}
    try:
        yield
    finally:
        if device_map is None:
            del hf.hf_device_map
        else:
            hf.hf_device_map = device_map


def base_model(hf: Any) -> Any:
    """The module a causal LM's forward calls for its final hidden state (or its envoy): the one under its
    `base_model_prefix` (`.model`; mamba2's `.backbone`)."""
    module = getattr(hf, "_module", hf)  # an envoy's model
    prefix = getattr(module, "base_model_prefix", "") or "model"
    inner = getattr(hf, prefix, None) if hasattr(module, prefix) else None
    return getattr(hf, "model", hf) if inner is None else inner


def decoder(hf: Any) -> Any:
    """The decoder stack (`.layers`, `.config`) of a transformers model or its envoy: the base model
    (`base_model`), or a multimodal one's `.language_model`."""
    inner = base_model(hf)
    return getattr(inner, "language_model", inner)


def decoder_layers(hf: Any) -> Any:
    """The decoder blocks of a transformers model (a ModuleList) or of its envoy (an envoy list)."""
    layers = getattr(decoder(hf), "layers", None)
    if layers is None:
        raise DeltaModelError(f"cannot find the decoder blocks of {type(hf).__name__}")
    return layers


def _attach_sites(hf: torch.nn.Module, spec: ModelSpec) -> dict[int, MixerSite]:
    sites: dict[int, MixerSite] = {}
    for i, block in enumerate(decoder_layers(hf)):
        if spec.kind(i) not in values.RECURRENT:  # a delta-rule or Mamba-2 block
            continue
        mixer = spec.family.mixer_of(block)
        if mixer is None:
            raise DeltaModelError(
                f"block {i} is a {spec.layer_types[i]} block but holds no {spec.family.mixer_class}")
        site = getattr(mixer, "_deltalang_site", None)
        if site is None:
            site = MixerSite(mixer, spec.family, i, spec.dims)
            mixer._deltalang_site = site
        sites[i] = site
    if sites:
        sites[max(sites)].last = True
    return sites
