"""Tiny random-weight checkpoints of every family, built offline in seconds.

For tests and for trying deltalang on an architecture without its weights:
`build_tiny("kimi_linear", path)` writes a loadable checkpoint (config,
safetensors, byte-level tokenizer) that `load_model(path)` opens like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import families

# 4 blocks: three DeltaNet, then attention, as the real checkpoints lay them out
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _family_names() -> tuple[str, ...]:
    return tuple(f.name for f in families.all_families() if f.block_kind == families.DELTANET_KIND)


# every delta-rule family deltalang recognises in the installed transformers: the conformance tests run on
# each (the Mamba-2 families: `testing_ssd.MAMBA2_FAMILY_NAMES`)
FAMILY_NAMES: tuple[str, ...] = _family_names()


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges: one token per byte, plus specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def tiny_config(family: str, vocab_size: int = 259) -> Any:
    """A small config of `family` with three DeltaNet blocks and one attention block.

    A family with no recipe below gets its config class with the shared small fields and the
    mechanism's (`_generic`): a new family of transformers is tried as it is."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, layer_types=list(LAYER_TYPES),
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    kda = dict(linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4)
    moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    recipe = _RECIPES.get(family, _generic)
    cfg = recipe(family, common, linear, kda, moe, rope)
    return cfg


def _config_class(family: str) -> Any:
    """The config class of `family`'s text model (the one with `layer_types`)."""
    from transformers import CONFIG_MAPPING

    fam = families.by_name(family)
    classes = [CONFIG_MAPPING[t] for t in fam.model_types if t in CONFIG_MAPPING]
    text = [c for c in classes if "layer_types" in getattr(c, "__annotations__", {})]
    if not (text or classes):
        raise ValueError(f"no config class for family {family!r}")
    return (text or classes)[0]


def _generic(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    fields = kda if families.by_name(family).per_channel_decay else linear
    return _config_class(family)(intermediate_size=128, rope_parameters=rope, **common, **fields)


def _qwen3_5(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    return _config_class(family)(intermediate_size=128, rope_parameters=rope, **common, **linear)


def _qwen_moe(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    extra = dict(intermediate_size=128, decoder_sparse_step=1) if family == "qwen3_next" else {}
    return _config_class(family)(rope_parameters=rope, **extra, **moe, **common, **linear)


def _olmo_hybrid(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    common.pop("head_dim")
    return _config_class(family)(intermediate_size=128, rope_parameters=rope, **common, **linear)


def _kimi_linear(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    common.pop("head_dim")
    common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: one kv head per head
    return _config_class(family)(
        intermediate_size=128, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=8, **kda, **common)


def _lara_mini(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    # its attention blocks come in two kinds: sliding (RoPE) and full (none)
    common["layer_types"] = [*LAYER_TYPES[:3], "sliding_attention", "full_attention"]
    common["num_hidden_layers"] = 5
    return _config_class(family)(rope_parameters=rope, sliding_window=8, **moe, **common, **linear)


def _qwen4_exp(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    # indexed attention blocks (every indexer field set), two residual streams, per-layer embeddings on
    # blocks 0 and 2 (their cache layers then keep three conv states)
    common["layer_types"] = [*LAYER_TYPES[:3], "indexed_attention"]
    return _config_class(family)(
        rope_parameters=rope, hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4,
        **moe, **common, **linear)


def _glm5_next(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    # a composite (vision + text) config; its indexer keeps every token (index_topk past any prompt here)
    from transformers import CONFIG_MAPPING

    common.pop("head_dim")
    common["num_key_value_heads"] = common["num_attention_heads"]
    common["layer_types"] = [*LAYER_TYPES[:3], "indexed_attention"]
    text = dict(
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, v_head_dim=16,
        qk_nope_head_dim=16, index_topk=256, index_head_dim=16, index_n_heads=2, index_kpool=16, hc_mult=2,
        mlp_layer_types=["dense", "sparse", "dense", "sparse"], **kda, **common)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    return CONFIG_MAPPING["glm5_next"](text_config=text, vision_config=vision, tie_word_embeddings=False)


def _bailing_hybrid(family: str, common: dict, linear: dict, kda: dict, moe: dict, rope: dict) -> Any:
    # its linear heads are the attention heads, head_dim their dim, short_conv_kernel_size the width
    common["head_dim"] = kda["linear_head_dim"]
    common["num_key_value_heads"] = common["num_attention_heads"]
    return _config_class(family)(
        intermediate_size=128, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, short_conv_kernel_size=4,
        **common)


_RECIPES = {
    "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen_moe, "qwen3_next": _qwen_moe, "olmo_hybrid": _olmo_hybrid,
    "kimi_linear": _kimi_linear, "lara_mini": _lara_mini, "qwen4_exp": _qwen4_exp, "glm5_next": _glm5_next,
    "bailing_hybrid": _bailing_hybrid,
}


def load_hf(path: str | Path, **kwargs: Any) -> Any:
    """Plain transformers' model of a checkpoint, through the Auto class that builds its family."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return families.auto_class(config).from_pretrained(path, **kwargs)


def build_tiny(family: str, path: str | Path, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of `family` to `path` and return the path."""
    path = Path(path)
    torch.manual_seed(seed)
    cfg = tiny_config(family)
    model = families.auto_class(cfg).from_config(cfg)
    model.eval()
    _enlarge_random_weights(model)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _enlarge_random_weights(model: torch.nn.Module) -> None:
    """Random init is tiny (std 0.02): scale projections so states and logits move visibly."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 1.0 / max(1.0, p.shape[1]) ** 0.5)
            elif "embed" in name:
                p.normal_(0.0, 1.0)


_BUILT: dict[str, Path] = {}


def built_once(name: str, build: Any, prefix: str = "deltalang-tiny-") -> Path:
    """`build(name, path)`'s checkpoint, built once per process in a temporary directory removed at exit."""
    import atexit
    import shutil
    import tempfile

    key = prefix + name
    if key not in _BUILT:
        root = Path(tempfile.mkdtemp(prefix=prefix))
        atexit.register(shutil.rmtree, root, True)
        _BUILT[key] = build(name, root / name)
    return _BUILT[key]


def tiny_checkpoint(family: str) -> Path:
    """A tiny checkpoint of `family`, built once per process in a temporary directory."""
    return built_once(family, build_tiny)


def main(argv: list[str] | None = None) -> int:
    """`python -m deltalang.models.testing FAMILY DIR`: write a tiny random checkpoint."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in FAMILY_NAMES:
        print(f"usage: python -m deltalang.models.testing {{{'|'.join(FAMILY_NAMES)}}} DIR", file=sys.stderr)
        return 2
    print(build_tiny(args[0], args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
