"""Tiny random-weight checkpoints of every family, built offline in seconds.

For tests and for trying deltalang on an architecture without its weights:
`build_tiny("kimi_linear", path)` writes a loadable checkpoint (config,
safetensors, byte-level tokenizer) that `load_model(path)` opens like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILY_NAMES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear")

# 4 blocks: three DeltaNet, then attention, as the real checkpoints lay them out
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


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
    """A small config of `family` with three DeltaNet blocks and one attention block."""
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, layer_types=list(LAYER_TYPES),
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    if family == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(intermediate_size=128, rope_parameters=rope, **common, **linear)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    elif family == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, rope_parameters=rope, **common, **linear)
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    elif family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(
            intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, rope_parameters=rope,
            **common, **linear)
        cfg.architectures = ["Qwen3NextForCausalLM"]
    elif family == "olmo_hybrid":
        common.pop("head_dim")
        cfg = tf.OlmoHybridConfig(intermediate_size=128, rope_parameters=rope, **common, **linear)
        cfg.architectures = ["OlmoHybridForCausalLM"]
    elif family == "kimi_linear":
        common.pop("head_dim")
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: one kv head per head
        cfg = tf.KimiLinearConfig(
            intermediate_size=128, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=8, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
            **common)
        cfg.architectures = ["KimiLinearForCausalLM"]
    else:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILY_NAMES)}")
    return cfg


def build_tiny(family: str, path: str | Path, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of `family` to `path` and return the path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    cfg = tiny_config(family)
    model = AutoModelForCausalLM.from_config(cfg)
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


def tiny_checkpoint(family: str) -> Path:
    """A tiny checkpoint of `family`, built once per process in a temporary directory."""
    import atexit
    import shutil
    import tempfile

    if family not in _BUILT:
        root = Path(tempfile.mkdtemp(prefix="deltalang-tiny-"))
        atexit.register(shutil.rmtree, root, True)
        _BUILT[family] = build_tiny(family, root / family)
    return _BUILT[family]


def main(argv: list[str] | None = None) -> int:
    """`python -m deltalang.testing FAMILY DIR`: write a tiny random checkpoint."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in FAMILY_NAMES:
        print(f"usage: python -m deltalang.testing {{{'|'.join(FAMILY_NAMES)}}} DIR", file=sys.stderr)
        return 2
    print(build_tiny(args[0], args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
