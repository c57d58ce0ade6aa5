#!/usr/bin/env python3
"""Compare training runs side by side from their ``--metrics-jsonl`` files.

    python tools/compare_runs.py runs/bf16.jsonl runs/loco4.jsonl --out runs/compare

Writes ``DIR/comparison.md`` (final and best eval loss, tokens/s, mean gradient-sync
time total and exposed per step, gradient and parameter bytes per step, compression
ratio, speedup vs the first run) and PNG plots: ``loss_vs_tokens.png``, ``loss_vs_time.png``,
``step_time.png`` (stacked: compute / exposed comm / LoCo compress) and
``bytes_per_step.png``. Labels come from each run's config ("LoCo 4-bit",
"bf16 reduce-scatter", ...) unless ``--labels`` gives them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from loco_megatron.metrics.variant import describe  # noqa: E402


@dataclasses.dataclass
class Run:
    path: str
    config: dict
    train: list[dict]
    """Records with ``train/lm_loss``, in iteration order."""
    evals: list[dict]
    """Records with ``eval/lm_loss``, in iteration order."""
    label: str = ""


def load_run(path: str) -> Run:
    """Read one metrics file; exits with one line naming the file when it is unusable."""
    p = pathlib.Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.jsonl"))
        if len(files) != 1:
            sys.exit(f"error: {path} is a folder with {len(files)} .jsonl files; name the file")
        p = files[0]
    if not p.is_file():
        sys.exit(f"error: {path} does not exist")
    config: dict = {}
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            sys.exit(f"error: {p}:{n} is not JSON")
        if "config" in rec:
            # A resumed run appends a new header (the last wins) saying where it resumed:
            # records past that point were logged by steps the resume redoes, so drop them.
            config = rec["config"]
            start = config.get("resumed_from_iteration", 0)
            for records in (train, evals):
                for it in [it for it in records if it > start]:
                    del records[it]
        elif "train/lm_loss" in rec:
            train[rec["iteration"]] = rec  # the latest value per iteration
        elif "eval/lm_loss" in rec:
            evals[rec["iteration"]] = rec
    if not train:
        sys.exit(f"error: {p} has no training metrics (was it written with --metrics-jsonl?)")
    return Run(str(p), config, [train[i] for i in sorted(train)], [evals[i] for i in sorted(evals)])


def _label_runs(runs: list[Run], labels: list[str] | None) -> None:
    if labels:
        if len(labels) != len(runs):
            sys.exit(f"error: --labels gives {len(labels)} labels for {len(runs)} runs")
        for r, lab in zip(runs, labels):
            r.label = lab
        return
    for r in runs:
        r.label = describe(r.config)
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:  # disambiguate equal labels with the experiment name or file name
        if seen[r.label] > 1:
            r.label += f" ({r.config.get('wandb_exp_name') or pathlib.Path(r.path).stem})"


def _weighted_mean(run: Run, key: str) -> float:
    """Per-step mean of ``key`` over the run, each log window weighted by its steps."""
    total = weight = 0.0
    prev = 0
    for rec in run.train:
        steps = rec["iteration"] - prev
        prev = rec["iteration"]
        if key in rec:
            total += rec[key] * steps
            weight += steps
    return total / weight if weight else float("nan")


def _steady(run: Run) -> list[dict]:
    """Training records after the first log window (which carries start-up costs)."""
    return run.train[1:] if len(run.train) > 1 else run.train


def summarize(run: Run) -> dict:
    steady = Run(run.path, run.config, _steady(run), run.evals)
    evals = [e["eval/lm_loss"] for e in run.evals]
    return {
        "label": run.label,
        "final_eval": evals[-1] if evals else float("nan"),
        "best_eval": min(evals) if evals else float("nan"),
        "final_train": run.train[-1]["train/lm_loss"],
        "tokens_per_s": statistics.median(r["train/tokens_per_s"] for r in steady.train),
        "step_s": statistics.median(r["train/step_s"] for r in steady.train),
        # The mean, unlike the median, carries rare long steps (DiLoCo's outer exchanges).
        "mean_step_s": _weighted_mean(steady, "train/step_s"),
        "outer_bytes_per_step": _zero_if_nan(_weighted_mean(steady, "comm/outer_bytes_sent")),
        "outer_time_s": _zero_if_nan(_weighted_mean(steady, "comm/outer_time_s")),
        "outer_exposed_s": _zero_if_nan(_weighted_mean(steady, "comm/outer_exposed_s")),
        # DiLoCo: what a bf16 ring all-reduce between the replicas at every step would send (computed)
        "outer_bf16_every_step": _zero_if_nan(_weighted_mean(steady, "comm/outer_bytes_bf16_every_step")),
        "comm_total_s": _weighted_mean(steady, "comm/grad_sync_total_s"),
        "comm_exposed_s": _weighted_mean(steady, "comm/grad_sync_exposed_s"),
        "compress_s": _weighted_mean(steady, "comm/compress_s"),
        "decompress_s": _weighted_mean(steady, "comm/decompress_s"),
        "bytes_per_step": _weighted_mean(steady, "comm/grad_bytes_sent"),
        # Runs logged before parameter bytes were counted show 0.
        "param_bytes_per_step": _zero_if_nan(_weighted_mean(steady, "comm/param_bytes_sent")),
        "inter_bytes_per_step": _weighted_mean(steady, "comm/grad_bytes_sent_inter"),
        # --param-gather-bits: the encode and the apply run on the rank (in the step), the
        # gather's launch-to-done also covers the wire; 0 for runs without it.
        "param_compress_s": _zero_if_nan(_weighted_mean(steady, "comm/param_compress_s")),
        "param_decompress_s": _zero_if_nan(_weighted_mean(steady, "comm/param_decompress_s")),
        "param_gather_s": _zero_if_nan(_weighted_mean(steady, "comm/param_gather_s")),
        "compression_ratio": _weighted_mean(steady, "comm/compression_ratio"),
        "tokens_seen": run.train[-1]["train/tokens_seen"],
    }


def _zero_if_nan(x: float) -> float:
    return 0.0 if x != x else x


def markdown_table(rows: list[dict]) -> str:
    base = rows[0]
    head = ("| run | final eval loss | best eval loss | tokens/s | step (s) | comm total / step (ms) "
            "| comm exposed / step (ms) | compress / decompress per step (ms) | grad bytes / step | param bytes / step "
            "| compression ratio "
            "| speedup vs first |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['final_eval']:.4f} | {r['best_eval']:.4f} | {r['tokens_per_s']:,.0f} "
            f"| {r['step_s']:.4f} | {r['comm_total_s'] * 1e3:.2f} | {r['comm_exposed_s'] * 1e3:.2f} "
            f"| {r['compress_s'] * 1e3:.2f} / {r['decompress_s'] * 1e3:.2f} | {r['bytes_per_step']:,.0f} "
            f"| {r['param_bytes_per_step']:,.0f} | {r['compression_ratio']:.3f} "
            f"| {base['step_s'] / r['step_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def _wall_clock(run: Run) -> tuple[list[float], list[float]]:
    """(cumulative training seconds, loss) at each training record."""
    t, prev, xs, ys = 0.0, 0, [], []
    for rec in run.train:
        t += rec["train/step_s"] * (rec["iteration"] - prev)
        prev = rec["iteration"]
        xs.append(t)
        ys.append(rec["train/lm_loss"])
    return xs, ys


def plot(runs: list[Run], rows: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot([x["train/tokens_seen"] for x in r.train], [x["train/lm_loss"] for x in r.train],
                label=f"{r.label} (train)")
        if r.evals:
            tokens = {x["iteration"]: x["train/tokens_seen"] for x in r.train}
            pts = [(tokens[e["iteration"]], e["eval/lm_loss"]) for e in r.evals if e["iteration"] in tokens]
            if pts:
                ax.plot(*zip(*pts), "o--", label=f"{r.label} (eval)")
    ax.set(xlabel="tokens", ylabel="LM loss", title="Loss vs tokens")
    ax.legend(fontsize=8)
    save(fig, "loss_vs_tokens.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot(*_wall_clock(r), label=r.label)
    ax.set(xlabel="training time (s)", ylabel="train LM loss", title="Loss vs wall-clock")
    ax.legend(fontsize=8)
    save(fig, "loss_vs_time.png")

    labels = [r["label"] for r in rows]
    exposed = [r["comm_exposed_s"] * 1e3 for r in rows]
    compress = [r["compress_s"] * 1e3 for r in rows]
    compute = [max(r["step_s"] * 1e3 - e - c, 0.0) for r, e, c in zip(rows, exposed, compress)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(labels, compute, label="compute (rest of step)")
    # Decompression runs inside the wait, so it is part of the exposed time already.
    ax.bar(labels, exposed, bottom=compute, label="exposed gradient sync (incl. LoCo decompress)")
    ax.bar(labels, compress, bottom=[a + b for a, b in zip(compute, exposed)], label="LoCo compress")
    ax.set(ylabel="ms per step", title="Per-step time")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=20)
    save(fig, "step_time.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grads = [r["bytes_per_step"] / 1e6 for r in rows]
    ax.bar(labels, grads, label="gradients")
    ax.bar(labels, [r["param_bytes_per_step"] / 1e6 for r in rows], bottom=grads, label="parameters (all-gather)")
    ax.set(ylabel="MB per rank per step", title="Data-parallel bytes per step")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=20)
    save(fig, "bytes_per_step.png")
    return written


def compare(paths: list[str], out: str, labels: list[str] | None = None) -> tuple[str, list[pathlib.Path]]:
    runs = [load_run(p) for p in paths]
    _label_runs(runs, labels)
    rows = [summarize(r) for r in runs]
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows)
    (out_dir / "comparison.md").write_text(table)
    return table, plot(runs, rows, out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="metrics .jsonl files (or folders holding one)")
    ap.add_argument("--out", required=True, help="folder for comparison.md and the PNG plots")
    ap.add_argument("--labels", nargs="+", help="one label per run (default: from each run's config)")
    args = ap.parse_args()
    table, written = compare(args.runs, args.out, args.labels)
    print(table)
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
