"""--async-save: megatron-core's AsyncCallsQueue runs a checkpoint's write in a background
process while training continues; its finalize functions (metadata, checksums, commit) run
on every rank once every rank's write finished."""

from __future__ import annotations


class AsyncWriter:
    """At most one write in flight. Every method is collective: all ranks call it at the
    same point of the program (the queue agrees on completion with an all-reduce)."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()

    def schedule(self, request) -> None:
        self.queue.schedule_async_request(request)

    def poll(self) -> None:
        """Finalize the write if every rank finished it; else return at once."""
        if self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        if self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=True)
