"""Pairwise (all-pairs) covering of test factors under constraints: a pure function.

Greedy: among every valid complete combination (the factor spaces here are small enough
to enumerate), repeatedly take the one that covers the most still-uncovered value pairs,
ties going to the cheapest, then the first in enumeration order - so the result is
deterministic. A pair that no valid combination holds is not required.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional


def _pairs(cell: dict, names: list) -> set:
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(names, 2)}


def coverable_pairs(factors: dict, valid: Callable[[dict], bool]) -> set:
    """Every ``((factor, value), (factor, value))`` pair some valid combination holds."""
    names = list(factors)
    out: set = set()
    for values in itertools.product(*factors.values()):
        cell = dict(zip(names, values))
        if valid(cell):
            out |= _pairs(cell, names)
    return out


def all_pairs(factors: dict, valid: Callable[[dict], bool],
              cost: Optional[Callable[[dict], float]] = None) -> list[dict]:
    """Valid combinations of ``factors`` ({name: values}) that together hold every
    coverable pair of values of any two factors."""
    names = list(factors)
    cost = cost or (lambda cell: 0)
    candidates = [dict(zip(names, values)) for values in itertools.product(*factors.values())]
    candidates = [c for c in candidates if valid(c)]
    pairs = [_pairs(c, names) for c in candidates]
    uncovered = set().union(*pairs) if pairs else set()
    cells: list[dict] = []
    while uncovered:
        best = min(range(len(candidates)), key=lambda i: (-len(pairs[i] & uncovered), cost(candidates[i]), i))
        cells.append(candidates[best])
        uncovered -= pairs[best]
    return cells
