"""The rows of ``docs/benchmarks.md``'s tables of measured figures against the project's
targets: what was measured, the figure a script printed and the target beside it. No row
says whether a target is met: the two columns are there to be compared."""

from __future__ import annotations

HEADER = ["| setting | figure | measured | target |", "|---|---|---|---|"]
"""The table's head (markdown), for :func:`row`'s rows."""


def row(setting: str, figure: str, measured: str, target: str = "") -> str:
    """One table row: ``setting`` (where it ran: topology, link, size), ``figure`` (what the
    number is), ``measured`` (as the script's output gives it) and ``target`` ("" when the
    project sets none for it)."""
    return f"| {setting} | {figure} | {measured} | {target} |"
