"""--async-save: megatron-core's AsyncCallsQueue runs a checkpoint's write in a background
process while training continues; its finalize functions (metadata, checksums, commit) run
on every rank once every rank's write finished."""

from __future__ import annotations


class AsyncWriter:
    """At most one write in flight. ``poll`` and ``wait`` are collective: all ranks call
    them at the same point of the program (the queue agrees on completion with an
    all-reduce); ``wait_local`` is not."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()

    def schedule(self, request) -> None:
        self.queue.schedule_async_request(request)

    def in_flight(self) -> bool:
        return bool(self.queue.get_num_unfinalized_calls())

    def poll(self) -> None:
        """Finalize the write if every rank finished it; else return at once."""
        if self.in_flight():
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        if self.in_flight():
            self.queue.maybe_finalize_async_calls(blocking=True)

    def wait_local(self) -> None:
        """Wait for this rank's background write to end, without finalizing it (no
        collective: for a rank leaving on an error the others may not share). The write's
        files stay in ``iter_N.tmp``, uncommitted."""
        while self.queue.async_calls:
            self.queue.async_calls.popleft().async_caller.close()
