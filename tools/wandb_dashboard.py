#!/usr/bin/env python3
"""Create a wandb report comparing communication time and loss across a group of runs.

    pip install -r requirements-wandb-reports.txt      # wandb-workspaces (reports API)
    wandb login
    python tools/wandb_dashboard.py --project loco --group bench-1gbit
    python tools/wandb_dashboard.py --project loco --group bench-1gbit --dry-run   # print, no network

Runs are selected by the ``wandb_group`` entry of their config (every run logs its
full config, so the group given with ``--wandb-group`` at training time) and grouped
by ``variant``. One panel per metric key: loss against tokens and steps, eval
loss, gradient-sync time total and exposed, LoCo compress/decompress time, bytes
sent per step, compression ratio, tokens/s and step time.
"""

from __future__ import annotations

import argparse
import json
import sys

PANELS = [
    {"title": "Train loss vs tokens", "x": "train/tokens_seen", "y": ["train/lm_loss_vs_tokens"]},
    {"title": "Train loss", "x": "Step", "y": ["train/lm_loss"]},
    {"title": "Eval loss", "x": "Step", "y": ["eval/lm_loss"]},
    {"title": "Gradient sync, launch to completion (s/step)", "x": "Step", "y": ["comm/grad_sync_total_s"]},
    {"title": "Gradient sync, exposed (s/step)", "x": "Step", "y": ["comm/grad_sync_exposed_s"]},
    {"title": "Slowest rank's exposed sync (s/step)", "x": "Step", "y": ["comm/grad_sync_exposed_s_max"]},
    {"title": "LoCo compress / decompress (s/step)", "x": "Step", "y": ["comm/compress_s", "comm/decompress_s"]},
    {"title": "Param all-gather (s/step)", "x": "Step", "y": ["comm/param_gather_s"]},
    {"title": "Gradient bytes sent per rank per step", "x": "Step", "y": ["comm/grad_bytes_sent"]},
    {"title": "Compression ratio", "x": "Step", "y": ["comm/compression_ratio"]},
    {"title": "Achieved bandwidth, bytes sent / collective time (Gbit/s)", "x": "Step", "y": ["comm/busbw_gbps"]},
    {"title": "Tokens/s", "x": "Step", "y": ["train/tokens_per_s"]},
    {"title": "Step time (s)", "x": "Step", "y": ["train/step_s"]},
    {"title": "LoCo error RMS / relative quantisation error", "x": "Step",
     "y": ["loco/error_rms", "loco/quant_rel_error"]},
]
"""The report's panels: one per metric key, so that every run appears on each."""


# Runs are averaged only within one variant (bits, parameter bits, two-hop, quantiser
# options, dtype: loco_megatron.metrics.variant), logged as the config key "variant".
GROUP_BY = ["variant"]


def run_filter(group: str | None) -> str:
    """wandb filter expression selecting the group's runs by their logged config."""
    if not group:
        return ""
    if "'" in group:
        raise ValueError(f"group names with quotes are not supported: {group!r}")
    return f"Config('wandb_group') == '{group}'"


def build_report(project: str, entity: str | None, group: str | None, title: str | None):
    """The report object (wandb-workspaces); nothing is sent until ``.save()``."""
    import wandb_workspaces.reports.v2 as wr

    kw = {"entity": entity} if entity else {}
    runset = wr.Runset(project=project, filters=run_filter(group), groupby=GROUP_BY,
                       name=group or "all runs", **kw)
    panels = [wr.LinePlot(title=p["title"], x=p["x"], y=list(p["y"])) for p in PANELS]
    report = wr.Report(project=project, title=title or f"LoCo communication: {group or project}",
                       description="Gradient-sync time, bytes and loss across runs (loco-megatron).", **kw)
    report.blocks = [
        wr.H1("Communication and loss"),
        wr.P("Exposed time is what the training step waited for gradient sync; total is launch to "
             "completion summed over buckets. Decompression runs inside the wait."),
        wr.PanelGrid(runsets=[runset], panels=panels),
    ]
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", required=True)
    ap.add_argument("--entity", help="wandb entity (default: your default entity)")
    ap.add_argument("--group", help="only runs trained with this --wandb-group")
    ap.add_argument("--title")
    ap.add_argument("--dry-run", action="store_true", help="print the report's panels and filter; no network")
    args = ap.parse_args()
    try:
        flt = run_filter(args.group)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if args.dry_run:
        print(json.dumps({"project": args.project, "filter": flt, "groupby": GROUP_BY,
                          "panels": PANELS}, indent=1))
        return
    try:
        import wandb_workspaces  # noqa: F401
    except ImportError:
        sys.exit("error: the reports API needs wandb-workspaces: pip install -r requirements-wandb-reports.txt")
    try:  # building it asks the API for the default entity already (not logged in: raises there)
        report = build_report(args.project, args.entity, args.group, args.title)
        report.save()
    except Exception as e:  # not logged in, no network, unknown project: one line
        why = str(e).splitlines()[0] if str(e) else repr(e)
        sys.exit(f"error: could not save the wandb report: {why}")
    print(report.url)


if __name__ == "__main__":
    main()
