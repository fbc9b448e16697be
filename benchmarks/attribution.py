"""Attribution over the recurrent memory: estimates against exact patching, and the cost, side by side.

Part 1, quality (the bundled model): for every pair of examples/data/landmarks.jsonl (clean prompt,
corrupt prompt of another landmark, same length) and for key-value recall pairs (the queried key's
value changed), M = logit(clean answer) - logit(corrupt answer), every DeltaNet block x every position
from the first token where the prompts differ. Exact effects: the sweep engine's full grid
(`deltalang.run_sweep`, method exact) minus M(clean). Estimates: `method="attribution"` with
steps 0 (plain) and k points of each integrated path (`PATHS_OF`: blocks, outputs, embeddings): equal
midpoints towards a donor, the Gauss-Radau rule with the clean run's gradient towards zeros
(`deltalang.sweep.paths.path_rule`).
Printed per write (state from the donor, whole memory from the donor, state zeroed, whole memory
zeroed): pooled Spearman, the mean number of each prompt's exact top-10 cells among its 20 largest
estimates (what `refine top 20` runs exactly), and the share of cells with |exact| > 1 whose sign is right.
Part 2, speed (random Qwen3.5-0.8B-shaped model, 18 DeltaNet blocks x 64 positions of a 64-token
prompt): `run_sweep(method="attribution", refine=20)` against the engine's full exact grid, in one run,
interleaved in rounds (each round: every estimate once, a third of the grid's positions) so that both
sides meet the same drifts of a shared machine.

    python benchmarks/attribution.py [--pairs N] [--png docs/attribution_scatter.png] [--no-speed]
                                     [--no-quality] [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import attrs  # noqa: E402
import torch  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, qwen35_08b_shaped, tokenizer_for  # noqa: E402

import deltalang  # noqa: E402
from deltalang.language.ast import quote  # noqa: E402
from deltalang.models.bundled import world  # noqa: E402
from deltalang.run import Experiment  # noqa: E402
from deltalang.runtime.model import wrap_model  # noqa: E402
from deltalang.sweep import run_sweeps  # noqa: E402
from deltalang.sweep.attribution import DONOR_STEPS, PATHS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WRITES = {
    "state, donor": ("write L.state_after(t) from other",),
    "memory, donor": ("write L.state_after(t) from other", "write L.conv_window_after(t) from other"),
    "state, zeros": ("write L.state_after(t) = zeros",),
    "memory, zeros": ("write L.state_after(t) = zeros", "write L.conv_window_after(t) = zeros"),
}


# the integrated paths and step counts measured per write (zeros: the blocks path moves each block's output
# to zero, what zeroing its state at every token gives)
PATHS_OF = {"state, donor": (("blocks", (1, 2, 4, 8)), ("outputs", (4,)), ("embeddings", (4,))),
            "memory, donor": (("blocks", (1, 2, 4, 8)), ("outputs", (4,))),
            "state, zeros": (("blocks", (2, 4, 8)),), "memory, zeros": (("blocks", (2, 4, 8)),)}


def landmark_pairs(n: int | None) -> list[tuple[str, str, str, str]]:
    rows = [json.loads(x) for x in (ROOT / "examples/data/landmarks.jsonl").read_text().splitlines() if x.strip()]
    return [(r["prompt"], r["corrupt"], r["answer"], r["foil"]) for r in rows][:n]


def recall_pairs(n: int) -> list[tuple[str, str, str, str]]:
    """Held-out recall prompts; the corrupt one gives the queried key another value wherever it is listed."""
    out = []
    values = sorted(world.RECALL_VALUES)
    for ex in world.heldout_examples("recall")[:n]:
        answer = ex.answer.strip()
        other = next(v for v in values if v != answer and f" {v} " not in ex.prompt)
        corrupt = ex.prompt.replace(f"key: {ex.subject} value: {answer}", f"key: {ex.subject} value: {other}")
        out.append((ex.prompt, corrupt, ex.answer, " " + other))
    return out


def source(model: deltalang.DeltaModel, clean: str, corrupt: str, a: str, b: str, body: tuple[str, ...]) -> str:
    ids, other = model.spec.token_ids(clean), model.spec.token_ids(corrupt)
    assert len(ids) == len(other), (clean, corrupt)
    first = next(i for i, (x, y) in enumerate(zip(ids, other, strict=True)) if x != y)
    lines = "".join(f"    {w}\n" for w in body)
    return (f"prompt clean = {quote(clean)}\nprompt other = {quote(corrupt)}\n"
            f"sweep s on clean over L in L[linear], t in {first}..{len(ids)} {{\n{lines}"
            f"    measure logit_diff({quote(a)}, {quote(b)})\n}}\n")


def one_pair(model: deltalang.DeltaModel, src: str, paths: tuple) -> dict[str, dict[tuple[int, int], float]]:
    """{"exact" | variant: {(block, position): effect}} for one prompt pair and one write."""
    exact = deltalang.run_sweep(src, model, progress=False)
    est = deltalang.run_sweep(src, model, method="attribution", steps=0)
    label = est.rows[0].measure
    out = {"exact": {(dict(r.point)["L"], dict(r.point)["t"]): r.value - est.clean[label]
                     for r in exact.tables[0].rows}}
    out["plain"] = est.grid()
    for path, ks in paths:
        for k in ks:
            out[f"{PATHS[path]}{k}"] = deltalang.run_sweep(src, model, method="attribution", steps=k, path=path).grid()
    return out


def figures(per_pair: list[dict[str, dict[tuple[int, int], float]]], variant: str) -> tuple[float, float, int, float]:
    """Pooled Spearman, mean / min exact top-10 found in the top-20 estimates, sign right on |exact| > 1."""
    xs, ys, found, signs = [], [], [], []
    for g in per_pair:
        cells = sorted(g["exact"])
        xs += [g[variant][c] for c in cells]
        ys += [g["exact"][c] for c in cells]
        top10 = set(sorted(cells, key=lambda c: -abs(g["exact"][c]))[:10])
        top20 = set(sorted(cells, key=lambda c: -abs(g[variant][c]))[:20])
        found.append(len(top10 & top20))
        signs += [(g[variant][c] > 0) == (g["exact"][c] > 0) for c in cells if abs(g["exact"][c]) > 1]
    rho = float(spearmanr(xs, ys).statistic)
    return rho, sum(found) / len(found), min(found), (sum(signs) / len(signs) if signs else float("nan"))


def quality(model: deltalang.DeltaModel, pairs: list[tuple[str, str, str, str]], name: str,
            writes: dict[str, tuple[str, ...]]) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    for wname, body in writes.items():
        paths = PATHS_OF.get(wname, ())
        results[wname] = [one_pair(model, source(model, *p, body), paths) for p in pairs]
        variants = ["plain", *(f"{PATHS[p]}{k}" for p, ks in paths for k in ks)]
        print(f"\n{name}, {wname} ({len(pairs)} pairs, {sum(len(g['exact']) for g in results[wname])} cells)")
        print(f"{'estimate':<10} {'Spearman':>9} {'top-10 in top-20 (mean/min)':>28} {'sign |exact|>1':>15}")
        for v in variants:
            rho, mean_found, min_found, sign = figures(results[wname], v)
            print(f"{v:<10} {rho:>9.3f} {f'{mean_found:.1f} / {min_found}':>28} {sign:>15.1%}")
    return results


def scatter(results: dict[str, list[dict]], path: Path, variant: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for ax, wname in zip(axes, ("state, donor", "memory, donor"), strict=True):
        for v, colour in (("plain", "#999999"), (variant, "#1f77b4")):
            xs = [g[v][c] for g in results[wname] for c in g["exact"]]
            ys = [g["exact"][c] for g in results[wname] for c in g["exact"]]
            ax.scatter(ys, xs, s=7, alpha=0.6, color=colour, label=v)
        lim = [min(ax.get_xlim()[0], ax.get_ylim()[0]), max(ax.get_xlim()[1], ax.get_ylim()[1])]
        ax.plot(lim, lim, color="black", lw=0.6)
        ax.set_xlabel("exact effect (sweep engine)")
        ax.set_ylabel("estimated effect")
        ax.set_title(f"landmarks, {wname}")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nscatter: {path}")


class PeakRSS:
    """The peak resident memory above the start of a `with` block, sampled every 2 ms (CPU: no allocator stats)."""

    def __enter__(self) -> "PeakRSS":
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed memory back, so the start is what is in use
        self.start = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()

    @staticmethod
    def _rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self) -> None:
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    @property
    def mib(self) -> float:
        return (self.peak - self.start) / 2**20


def speed(threads: int, rounds: int) -> None:
    """Every estimate against the exact engine's full grid, interleaved: in each of `rounds` rounds each
    estimate runs once and the engine runs a `rounds`-th of the grid (every `rounds`-th position, all
    blocks: each position's rows batch as in the whole grid), so that both sides meet the same slow
    drifts of this shared machine; an estimate's time is its median, the grid's the sum of its parts."""
    hf = qwen35_08b_shaped()
    model = wrap_model(hf, tokenizer_for(), "random Qwen3.5-0.8B-shaped")
    text = ("The Eiffel Tower is in the city of Paris, and the Louvre is near the " * 2)[:64]
    donor = ("The Brandenburg Gate is in the city of Berlin, and the Reichstag is " * 2)[:64]
    src = (f"prompt clean = {quote(text)}\nprompt other = {quote(donor)}\n"
           f"sweep s on clean over L in L[linear], t in 0..64 {{\n    write L.state_after(t) from other\n"
           f"    measure logit_diff(\"a\", \"e\")\n}}\n")
    deltalang.run_sweep(src, model, method="attribution", steps=0)  # warm-up (kernels, first calls)
    ids = torch.tensor([model.spec.token_ids(text)])
    with PeakRSS() as fwd:
        logits = hf(ids, use_cache=False, logits_to_keep=1).logits
        (logits[0, -1, 0] - logits[0, -1, 1]).backward()
        hf.zero_grad(set_to_none=True)
        del logits
    with PeakRSS() as est_mem:
        deltalang.run_sweep(src, model, method="attribution")
    d = model.spec.dims
    block = len(ids[0]) * d["heads"] * d["key_dim"] * d["value_dim"] * 4 / 2**20
    runs = [(f"estimate (blocks, k={k}{', the default' if k == DONOR_STEPS else ''}) + refine top 20",
             {"steps": k}) for k in sorted({DONOR_STEPS, 1, 2, 4}, reverse=True)]
    runs.append(("estimate (plain) + refine top 20", {"steps": 0}))
    exp = deltalang.compile(src, model)
    sw = exp.resolved.runs[-1]
    n_tok = len(ids[0])
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    parts: list[float] = []
    exact_rows: list = []
    for r in range(rounds):
        for name, kw in runs:
            t0 = time.perf_counter()
            est = deltalang.run_sweep(src, model, method="attribution", refine=20, **kw)
            times[name].append(time.perf_counter() - t0)
        positions = list(range(r, n_tok, rounds))
        axes = (sw.axes[0], attrs.evolve(sw.axes[1], values=tuple(positions), labels=tuple(positions)))
        sub = Experiment(src, model, resolved=attrs.evolve(exp.resolved, runs=(*exp.resolved.runs[:-1],
                                                                                attrs.evolve(sw, axes=axes))))
        t0 = time.perf_counter()
        exact_rows += run_sweeps(sub, progress=False).tables[0].rows
        parts.append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{v[-1]:.1f}" for v in times.values()) +
              f" s; exact positions {r}::{rounds} {parts[-1]:.1f} s", flush=True)
    base = sum(parts)
    print(f"\nspeed: random Qwen3.5-0.8B-shaped model, 64-token prompt, 18 blocks x 64 positions = "
          f"{18 * n_tok} cells, {threads} thread(s); {rounds} interleaved rounds")
    print(f"{'':<52} {'seconds':>8} {'vs exact grid':>14} {'rounds (s)':>22}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<52} {med:8.1f} {base / med:13.1f}x {' / '.join(f'{t:.1f}' for t in ts):>22}")
    print(f"{'exact engine, full grid (the sum of its parts)':<52} {base:8.1f} {1:13.1f}x "
          f"{' / '.join(f'{t:.1f}' for t in parts):>22}")
    label = est.rows[0].measure
    got = {(dict(r.point)["L"], dict(r.point)["t"]): r.value - est.clean[label] for r in exact_rows}
    worst = max(abs(r.exact - got[(r.block, r.position)]) for r in est.refined())
    print(f"refined cells against the engine's grid: max |diff| {worst:.2e}")
    print(f"peak memory above the start (RSS): a forward with gradients + backward (batch 1) {fwd.mib:.0f} MiB; "
          f"the default estimate {est_mem.mib:.0f} MiB; one block's per-token states {block:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=None, help="only the first N landmark pairs")
    ap.add_argument("--recall", type=int, default=8, help="recall pairs")
    ap.add_argument("--png", default=None, help="write the scatter here")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-quality", action="store_true", help="the speed part only")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the speed part")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# benchmarks/attribution.py, {datetime.date.today()}, {machine()}")
    if not args.no_quality:
        model = deltalang.load_model()
        res = quality(model, landmark_pairs(args.pairs), "landmarks", WRITES)
        quality(model, recall_pairs(args.recall), "recall", {"state, donor": WRITES["state, donor"]})
        if args.png:
            scatter(res, Path(args.png), f"blk{DONOR_STEPS}")
    if not args.no_speed:
        speed(args.threads, args.rounds)


if __name__ == "__main__":
    main()
