"""pretrain_gpt.py with LoCo's collectives (gradient sync, the compressed parameter
gather, DiLoCo's outer exchanges) recorded and randomly delayed, for the collective-order tests. Each rank writes the sequence of (communicator ranks,
operation, elements) it issued to ``$LOCO_TEST_RECORD_DIR/rank<R>.json``.

The delays (0-20 ms before each collective is issued) and a work handle whose
``is_completed()`` answers False at random until waited on (legal: the collective may
still be in flight) make any timing-dependent launch order show up as different
sequences on different ranks.
"""

import json
import os
import pathlib
import random
import sys
import time
import warnings

import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.diloco.setup import build_outer_step
from loco_megatron.loco.collectives import CollectiveOps
from loco_megatron.loco.hooks import GradSyncHook, ParamGatherHook
from loco_megatron.training.trainer import train


class _FlakyWork:
    def __init__(self, work, rng):
        self._work, self._rng, self._waited = work, rng, False

    def is_completed(self) -> bool:
        return self._waited or (self._rng.random() < 0.3 and self._work.is_completed())

    def wait(self):
        time.sleep(self._rng.random() * 0.01)
        self._work.wait()
        self._waited = True


def recording_ops(log: list, rng: random.Random) -> CollectiveOps:
    def wrap(name, fn):
        def op(out, inp, group=None, async_op=False):
            numel = sum(t.numel() for t in inp) if isinstance(inp, list) else inp.numel()
            log.append([dist.get_process_group_ranks(group), name, numel])
            time.sleep(rng.random() * 0.02)
            work = fn(out, inp, group=group, async_op=async_op)
            return _FlakyWork(work, rng) if work is not None else None
        return op

    def reduce(tensor, group=None, async_op=False, **kwargs):  # all_reduce's signature
        log.append([dist.get_process_group_ranks(group), "all_reduce", tensor.numel()])
        time.sleep(rng.random() * 0.02)
        work = dist.all_reduce(tensor, group=group, async_op=async_op, **kwargs)
        return _FlakyWork(work, rng) if work is not None else None

    return CollectiveOps(all_to_all_single=wrap("all_to_all", dist.all_to_all_single),
                         all_gather=wrap("all_gather", dist.all_gather),
                         all_gather_into_tensor=wrap("all_gather", dist.all_gather_into_tensor), all_reduce=reduce)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    log: list = []
    ops = recording_ops(log, random.Random(1000 + env.rank))
    factory = lambda chunks, loco, stats: GradSyncHook(chunks, loco, stats, ops=ops)  # noqa: E731
    param_factory = lambda chunks, opt, loco, stats: ParamGatherHook(chunks, opt, loco, stats, ops=ops)  # noqa: E731
    outer_factory = lambda cfg, chunks, opt, stats, say: build_outer_step(cfg, chunks, opt, stats, say,  # noqa: E731
                                                                          ops=ops)
    train(config, env, grad_sync_factory=factory, param_sync_factory=param_factory, outer_step_factory=outer_factory)
    out = pathlib.Path(os.environ["LOCO_TEST_RECORD_DIR"]) / f"rank{env.rank}.json"
    out.write_text(json.dumps(log))
