"""Progress lines for slow start-up phases, so that a long first start never looks hung."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Optional

EVERY_S = 20.0
"""Seconds between progress lines: a phase that ends sooner prints none."""


@contextlib.contextmanager
def progress(what: str, say: Optional[Callable[[str], None]], every_s: float = EVERY_S) -> Iterator[None]:
    """While the body runs, ``say(f"... still {what} ({N} s)")`` every ``every_s`` seconds
    (a daemon thread; nothing when ``say`` is None). Start-up phases only: never around
    training steps, whose ranks must not be slowed by a printer."""
    if say is None:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            say(f"... still {what} ({time.monotonic() - t0:.0f} s)")

    thread = threading.Thread(target=tick, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
