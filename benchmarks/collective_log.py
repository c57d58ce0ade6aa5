"""pretrain_gpt.py with every torch.distributed collective recorded: megatron-core's, the
checkpointer's and ours alike (``benchmarks/crossing.py``; the collective-crossing test of
tests/test_diloco.py).

    LOCO_COLLECTIVE_LOG_DIR=DIR torchrun --nproc_per_node 2 benchmarks/collective_log.py [flags]

Each rank writes ``DIR/all_rank<R>.json``: ``[phase, group ranks, op, waited]`` per
collective issued, where ``phase`` is the training step whose work issued it (the step
itself and everything the trainer does after it, up to the next step), 0 before the first
step and ``"end"`` after the last one (the end of the run), and ``waited`` the phase in
which its work handle was waited for (``phase`` itself for a collective issued without
``async_op``; None if never waited). Every collective entry point of ``torch.distributed``
is wrapped, in both namespaces code reaches it by (``torch.distributed`` and
``torch.distributed.distributed_c10d``).
"""

import functools
import json
import os
import pathlib
import sys
import warnings

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import loco_megatron.training.trainer as trainer  # noqa: E402
from loco_megatron.cli import main_config  # noqa: E402

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
       "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast", "barrier",
       "all_gather_object", "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
       "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv", "monitored_barrier",
       "all_reduce_coalesced", "all_gather_coalesced")


class _Waited:
    """A work handle that notes the phase it is waited in (``entry[3]``)."""

    def __init__(self, work, entry: list, phase: list):
        self._work, self._entry, self._phase = work, entry, phase

    def wait(self, *args, **kwargs):
        if self._entry[3] is None:
            self._entry[3] = self._phase[0]
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def install(log: list, phase: list) -> None:
    """Wrap every collective of torch.distributed to append ``[phase, ranks, op, waited]``
    to ``log``; ``phase[0]`` is read at each call."""
    inside = [False]

    def wrap(name, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if inside[0]:  # the call re-dispatched by a torch function mode (the CPU platform layer's)
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if name == "batch_isend_irecv":
                group = args[0][0].group if args and args[0] else None
            entry = [phase[0], dist.get_process_group_ranks(group or dist.group.WORLD), name, None]
            log.append(entry)
            inside[0] = True
            try:
                work = fn(*args, **kwargs)
            finally:
                inside[0] = False
            if work is None or isinstance(work, list):
                entry[3] = phase[0]  # synchronous: done when it returns
                return work
            return _Waited(work, entry, phase)
        return recorded

    for name in OPS:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        wrapped = wrap(name, fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    log: list = []
    phase = [0]
    install(log, phase)
    step = trainer.train_step

    def counted_step(*args, **kwargs):
        phase[0] += 1
        return step(*args, **kwargs)

    end = trainer.end_of_run

    def counted_end(*args, **kwargs):
        phase[0] = "end"
        return end(*args, **kwargs)

    trainer.train_step, trainer.end_of_run = counted_step, counted_end
    trainer.train(config, env)
    out = pathlib.Path(os.environ["LOCO_COLLECTIVE_LOG_DIR"]) / f"all_rank{env.rank}.json"
    out.write_text(json.dumps(log))
