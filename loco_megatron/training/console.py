"""What rank 0 prints: one line at a time, flushed (every other rank stays silent)."""

from __future__ import annotations

from typing import Callable


def say_fn(is_logging_rank: bool) -> Callable[[str], None]:
    """A one-line printer that prints on the logging rank only."""
    return (lambda line: print(line, flush=True)) if is_logging_rank else (lambda line: None)


def say(layout, line: str) -> None:
    """Print ``line`` (when not empty) on ``layout``'s logging rank."""
    if line and layout.is_logging_rank:
        print(line, flush=True)
