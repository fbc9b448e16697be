"""Train the bundled tiny hybrid (deltalang/models/bundled/model/) from scratch, deterministically.

    python scripts/train_bundled.py            # trains, evaluates, saves, writes training_report.json
    python scripts/train_bundled.py --out DIR  # somewhere else
    python scripts/train_bundled.py --family granitemoehybrid   # the Mamba-2 hybrid (deltalang/models/bundled/mamba2_model/)

A `Qwen3_5ForCausalLM` with 8 blocks laid out L L L A L L L A, as the real
Qwen3.5 checkpoints are (three gated-DeltaNet blocks, then attention; block 0 is
a DeltaNet block, as every example in DESIGN assumes), width-4 convolution,
hidden 128, attention without rotary position (partial_rotary_factor 0), trained
on the synthetic world of `deltalang.models.bundled.world` with a word-level tokenizer
built here. Without rotary position the attention blocks cannot pick the subject
out of their key/value cache by where it sits, so the DeltaNet memory (state and
convolution window) is what carries it to the answer (FINDINGS measured this
layout: replacing the whole memory after "Tower" removes " Paris"), and
patching that memory visibly changes answers. (Attention first in each group,
A L L L, carries the subject the same way with rotary position, but puts an
attention block at L0.)

Beyond FINDINGS' recipe it took: DeltaNet decays initialised to last
(`init_decays`; with transformers' defaults most heads forget within a token and
key-value recall never trains), and recall sequences that ask for earlier keys
again, with loss on each repeat, given a large share of the first 300 steps
(`RECALL_SHARE`). The held-out figures: 100% on landmarks, foods and recall,
92% on people (the misses are almost all the phrasing "Ask anyone: <name> works
as a"). Learning the facts first instead got every person right but left
recall at 84% after 1,200 steps on this layout.

About 1.9M parameters, float32, ~8 MB; about 9 minutes on 2 quiet CPU threads
(17 when the cores are shared).
Fixed seeds and `torch.use_deterministic_algorithms(True)`: two runs on the same
machine give the same weights and figures.

`--family granitemoehybrid` trains the second bundled model, a Mamba-2 hybrid
(`GraniteMoeHybridForCausalLM`, the family of Granite-4.0-H), on the same world,
tokenizer, batches, seeds and schedule: the same layout with Mamba-2 blocks
(M M M A M M M A), dense (no experts: the shared MLP of width 384), attention
without position (granitemoehybrid's `position_embedding_type` None), 8 Mamba-2
heads of 32 over an inner width of 256, d_state 16, one group, width-4
convolution, chunk 16 (transformers' torch scan on a CPU costs more with a
longer chunk), the decays started by the same `init_decays`. 1.98M parameters,
~8 MB. Held-out: landmarks 96.7%, people and foods 100%, recall 68% (overall
83.2%: its check of 95% fails, on recall); the whole memory after the subject
carries the landmark facts as in the first model (halves P(answer) for 96.7% of
landmarks; the state alone for 4.7%). 1,474 s on 2 CPU threads shared with
about 8 other processes. A run with d_state 32 and recall's high share kept to
step 600 was behind this one at step 800 (landmarks 86.8%, recall 45.3%, every
4th held-out example) and was stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

# OpenMP threads that spin while waiting stall badly when another process shares
# the two cores (steps of 30 s instead of 0.3 s); waiting passively costs little.
# Scheduling only: results do not depend on it. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deltalang.models.bundled import MAMBA2_PATH, PATH, world  # noqa: E402
from deltalang.models.bundled import measure  # noqa: E402

SEED = 1234
THREADS = 2

# the architecture
HIDDEN = 128
INTERMEDIATE = 384
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
ATTN_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
LINEAR_K_HEADS, LINEAR_V_HEADS, LINEAR_K_DIM, LINEAR_V_DIM = 4, 4, 32, 32
CONV_WIDTH = 4

# the training run
STEPS = 1200
BATCH = 32
ROW = 64  # tokens per row: the chunked DeltaNet kernel pads to 64 anyway
LR = 3e-3
WARMUP = 60
MIN_LR_SHARE = 0.05
WEIGHT_DECAY = 0.01
# share of examples drawn from the key-value recall sequences: high at first, so
# that recall (a mechanism) forms early, then low, so that the facts (memorised
# one by one) get the exposures they need
RECALL_SHARE = (0.5, 0.25)
RECALL_SWITCH = 300  # the step where the share drops
EVAL_EVERY = 200

# the Mamba-2 hybrid (`--family granitemoehybrid`): the same layout, M M M A M M M A, dense (no experts),
# attention without position (granitemoehybrid's position_embedding_type None); 8 Mamba-2 heads of 32
# over an inner width of 256, d_state 16, one group, chunk 16 (the torch scan's cost grows with the chunk)
FAMILIES = ("qwen3_5", "granitemoehybrid")
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_CHUNK = 8, 32, 16, 16

LIMITS = {"heldout_accuracy": 0.95, "p_paris": 0.5, "whole_memory_ratio": 0.5}
MAX_BYTES = 15 * 1024 * 1024


def make_config(tokenizer, family: str = "qwen3_5"):
    if family == "granitemoehybrid":
        return make_mamba2_config(tokenizer)
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=ATTN_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        linear_conv_kernel_dim=CONV_WIDTH,
        linear_key_head_dim=LINEAR_K_DIM,
        linear_value_head_dim=LINEAR_V_DIM,
        linear_num_key_heads=LINEAR_K_HEADS,
        linear_num_value_heads=LINEAR_V_HEADS,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def make_mamba2_config(tokenizer):
    """granitemoehybrid, dense, no rotary position: the layout and widths of the Qwen3.5 model's config."""
    from transformers import GraniteMoeHybridConfig

    cfg = GraniteMoeHybridConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        shared_intermediate_size=INTERMEDIATE,
        num_local_experts=0,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),  # granitemoehybrid names its Mamba-2 blocks "linear_attention"
        num_attention_heads=ATTN_HEADS,
        num_key_value_heads=KV_HEADS,
        attention_multiplier=HEAD_DIM**-0.5,  # granite's attention scale (its default 1.0 is unscaled)
        position_embedding_type=None,
        mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=MAMBA_HEAD_DIM,
        mamba_d_state=MAMBA_STATE,
        mamba_n_groups=1,
        mamba_chunk_size=MAMBA_CHUNK,
        mamba_d_conv=CONV_WIDTH,
        mamba_expand=MAMBA_HEADS * MAMBA_HEAD_DIM // HIDDEN,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    cfg.architectures = ["GraniteMoeHybridForCausalLM"]
    return cfg


class Batches:
    """Rows of ROW tokens packed with examples separated by <eos>; loss on answer tokens only.

    Each row starts with an example at position 0 (as prompts are evaluated);
    later examples follow an <eos>. A recall sequence that asks for a key again
    before its final query also has loss on the repeated value. Deterministic
    given the seed.
    """

    def __init__(self, tokenizer, seed: int):
        self.rng = random.Random(seed)
        self.recall_share = RECALL_SHARE[0]
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id

        def encode(ex):
            """(token ids of prompt + answer, {position: token that position must predict})."""
            p = tokenizer(ex.prompt, add_special_tokens=False).input_ids
            a = tokenizer(ex.answer, add_special_tokens=False).input_ids
            assert len(a) == 1, ex
            targets = {len(p) - 1: a[0]}
            if ex.relation == "recall":
                # pair i is the six tokens 'key' ':' ' k' ' value' ':' ' v' at 6i
                seen = set()
                for i, (k, v) in enumerate(world.recall_pairs(ex.prompt)):
                    assert tokenizer.convert_ids_to_tokens(p[6 * i + 2]) == "Ġ" + k, ex
                    if k in seen:
                        targets[6 * i + 4] = p[6 * i + 5]
                    seen.add(k)
            return p + a, targets

        self.facts = [encode(e) for e in world.training_examples() if e.relation != "recall"]
        self.recall = [encode(e) for e in world.training_examples("recall")]

    def draw(self):
        pool = self.recall if self.rng.random() < self.recall_share else self.facts
        return pool[self.rng.randrange(len(pool))]

    def row(self):
        ids: list[int] = []
        targets: list[int] = []  # what each position must predict; -100: no loss
        while True:
            seq, tgt = self.draw()
            if ids and len(ids) + 1 + len(seq) > ROW:
                break
            if ids:
                ids.append(self.eos)
                targets.append(-100)
            targets += [tgt.get(i, -100) for i in range(len(seq))]
            ids += seq
        ids += [self.pad] * (ROW - len(ids))
        targets += [-100] * (ROW - len(targets))
        return ids, targets

    def batch(self):
        rows = [self.row() for _ in range(BATCH)]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


def init_decays(model) -> None:
    """Start every DeltaNet (or Mamba-2) head with a memory that lasts.

    transformers initialises dt_bias to 1 and A in (0.01, 16), so most heads
    start by forgetting their state within a token (decay exp(-A softplus(1))),
    where the decay's gradient vanishes too; key-value recall then never
    trains. As in Mamba and flash-linear-attention: A in (1, 16) and
    dt = softplus(dt_bias) log-uniform in (0.001, 0.1), so that per-token
    log-decays start between about -0.001 and -1.6. A Mamba-2 block's decay
    is the same function of the same two parameters (exp(-exp(A_log) dt)), and
    transformers starts it the same way (A_log = log(1..heads), dt_bias 1).
    """
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for i, t in enumerate(model.config.layer_types):
            if t != "linear_attention":
                continue
            block = model.model.layers[i]
            mixer = block.linear_attn if hasattr(block, "linear_attn") else block.mamba
            h = mixer.A_log.numel()
            a = torch.empty(h).uniform_(1, 16, generator=g)
            dt = torch.exp(torch.empty(h).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
            mixer.A_log.copy_(a.log())
            mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def lr_at(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (MIN_LR_SHARE + (1 - MIN_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * t)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(THREADS)
    try:
        torch.use_deterministic_algorithms(True)
    except Exception as e:  # pragma: no cover - depends on the build
        print(f"deterministic algorithms unavailable: {e}")


def train(out: Path, family: str = "qwen3_5") -> dict:
    from transformers import GraniteMoeHybridForCausalLM, Qwen3_5ForCausalLM

    seed_everything(SEED)
    tokenizer = world.build_tokenizer()
    config = make_config(tokenizer, family)
    model = (GraniteMoeHybridForCausalLM if family == "granitemoehybrid" else Qwen3_5ForCausalLM)(config)
    init_decays(model)
    n_params = sum(p.numel() for p in model.parameters())
    mark = "M" if family == "granitemoehybrid" else "L"
    print(f"model: {n_params:,} parameters, layers {''.join('A' if t == 'full_attention' else mark for t in LAYER_TYPES)}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95),
    )  # fmt: skip
    data = Batches(tokenizer, SEED)
    start = time.time()
    running = None
    for step in range(STEPS):
        model.train()
        data.recall_share = RECALL_SHARE[0] if step < RECALL_SWITCH else RECALL_SHARE[1]
        ids, targets = data.batch()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        running = value if running is None else 0.95 * running + 0.05 * value
        if (step + 1) % 50 == 0:
            print(f"step {step + 1:5d}  loss {running:.4f}  lr {lr_at(step):.2e}  {time.time() - start:6.0f}s", flush=True)
        if (step + 1) % EVAL_EVERY == 0 and step + 1 < STEPS:
            model.eval()
            acc = measure.heldout_accuracy(model, tokenizer, every=4)
            print("  held-out (every 4th): " + "  ".join(f"{k} {v['accuracy']:.3f}" for k, v in acc.items()), flush=True)
    train_seconds = time.time() - start
    model.eval()

    # save, then measure what was saved, loaded back the way users load it
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    loaded, loaded_tok = measure.load(out)
    figures = measure.report(loaded, loaded_tok)

    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    eiffel, lm, acc = figures["eiffel"], figures["landmarks"], figures["heldout_accuracy"]
    checks = {
        "heldout_accuracy_overall >= 0.95": acc["overall"]["accuracy"] >= LIMITS["heldout_accuracy"],
        "p_paris >= 0.5": eiffel["clean"] >= LIMITS["p_paris"],
        "whole_memory_patch_halves_p_paris": eiffel["whole_memory"] <= LIMITS["whole_memory_ratio"] * eiffel["clean"],
        "size <= 15 MB": sum(sizes.values()) + 4096 <= MAX_BYTES,
    }
    report = {
        "architecture": architecture(family, len(tokenizer), n_params),
        "training": {
            "steps": STEPS, "batch": BATCH, "row_tokens": ROW, "lr": LR, "seed": SEED, "threads": THREADS,
            "recall_share": RECALL_SHARE, "recall_switch": RECALL_SWITCH, "final_loss_ema": running, "train_seconds": round(train_seconds, 1),
            "torch": torch.__version__,
        },  # fmt: skip
        "world": {
            "train_examples": len(world.facts()),
            "heldout_examples": len(world.heldout()),
            "landmarks": len(world.landmarks()), "people": len(world.people()), "foods": len(world.foods()),
        },  # fmt: skip
        **figures,
        "files_bytes": sizes,
        "checks": checks,
    }
    # the report is written last, so count its own size into the total afterwards
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def architecture(family: str, vocab: int, n_params: int) -> dict:
    """The report's architecture entry."""
    common = {
        "layer_types": LAYER_TYPES, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "attention_heads": ATTN_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
    }  # fmt: skip
    if family == "granitemoehybrid":
        mamba = {
            "mamba_heads": MAMBA_HEADS, "mamba_head_dim": MAMBA_HEAD_DIM, "mamba_d_state": MAMBA_STATE,
            "mamba_groups": 1, "mamba_chunk_size": MAMBA_CHUNK, "conv_width": CONV_WIDTH, "position": "none",
        }  # fmt: skip
        return {"class": "GraniteMoeHybridForCausalLM", **common, **mamba, "vocab_size": vocab, "parameters": n_params}
    return {
        "class": "Qwen3_5ForCausalLM", **common,
        "linear_key_heads": LINEAR_K_HEADS, "linear_value_heads": LINEAR_V_HEADS,
        "linear_key_dim": LINEAR_K_DIM, "linear_value_dim": LINEAR_V_DIM,
        "conv_width": CONV_WIDTH, "vocab_size": vocab, "parameters": n_params,
    }  # fmt: skip


def print_report(r: dict) -> None:
    acc, e, lm = r["heldout_accuracy"], r["eiffel"], r["landmarks"]
    print()
    print(f"trained {r['training']['steps']} steps in {r['training']['train_seconds']:.0f}s, final loss {r['training']['final_loss_ema']:.4f}")
    print("held-out top-1 accuracy:")
    for k, v in acc.items():
        print(f"  {k:9s} {v['accuracy']:.4f}  (n={v['n']})")
    print(f"P(' Paris' | {world.EIFFEL_PROMPT!r}) = {e['clean']:.6f}")
    print(f"prefix 'The Eiffel Tower' ({e['prefix_tokens']} tokens), donor: the pizza prompt's first {e['prefix_tokens']} tokens")
    print(f"  prefix then rest through the cache, unpatched: P = {e['cache_unpatched']:.6f}  (max |logit diff| vs full forward {e['split_max_abs_logit_diff']:.2e})")
    print(f"  state only patched:                           P = {e['state_only']:.6f}")
    print(f"  whole memory (state + conv window) patched:   P = {e['whole_memory']:.6f}")
    print(f"  donor = whole pizza prompt: state only {e['state_only_full_donor']:.6f}, whole memory {e['whole_memory_full_donor']:.6f}")
    print(f"landmarks (n={lm['n']}, mean clean P {lm['mean_clean']:.4f}):")
    print(f"  whole-memory patch halves P(answer): {lm['whole_memory_halves_share']:.3f}  (mean P after {lm['whole_memory_mean_p']:.4f})")
    print(f"  state-only patch halves P(answer):   {lm['state_only_halves_share']:.3f}  (mean P after {lm['state_only_mean_p']:.4f})")
    print(f"  whole memory from another landmark -> P(donor's city) > 0.5: {lm['whole_memory_from_other_landmark_answers_donor_city_share']:.3f} (pairs {lm['other_landmark_donor_pairs']})")
    total = sum(r["files_bytes"].values())
    print("files: " + ", ".join(f"{k} {v:,}" for k, v in r["files_bytes"].items()) + f"; total {total:,} bytes (+ report)")
    for k, ok in r["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {k}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=FAMILIES, default="qwen3_5",
                    help="qwen3_5 (gated DeltaNet, the default) or granitemoehybrid (Mamba-2)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"output directory (default {PATH}, or {MAMBA2_PATH} for granitemoehybrid)")
    ap.add_argument("--steps", type=int, default=None, help=f"training steps (default and shipped: {STEPS})")
    args = ap.parse_args(argv)
    if args.steps is not None:
        globals()["STEPS"] = args.steps
    if args.out is None:
        args.out = MAMBA2_PATH if args.family == "granitemoehybrid" else PATH
    report = train(args.out, args.family)
    print_report(report)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"total size of {args.out}: {size:,} bytes")
    return 0 if all(report["checks"].values()) and size <= MAX_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
