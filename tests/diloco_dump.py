"""pretrain_gpt.py with DiLoCo's models dumped for tests/test_diloco_export.py.

Each rank writes ``$LOCO_TEST_DUMP_DIR/<tag>_rank<R>.pt`` (the model's parameters by
``state_dict`` name, fp32 clones): ``outer<T>`` right after the outer step of iteration T
(every outer step), ``local_end`` before the run's final outer step is taken (the local
model the checkpoint keeps) and ``final`` after it (the model the replica ends on).
"""

import os
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.diloco.setup import build_outer_step
from loco_megatron.training.trainer import train


def dumping_outer_step(config, chunks, optimizer, stats, log):
    outer = build_outer_step(config, chunks, optimizer, stats, log)
    folder = pathlib.Path(os.environ["LOCO_TEST_DUMP_DIR"])

    def dump(tag: str) -> None:
        params = {n: p.detach().float().clone() for n, p in chunks[0].module.named_parameters()}
        torch.save(params, folder / f"{tag}_rank{dist.get_rank()}.pt")

    after_step, take_final = outer.after_step, outer.take_final

    def after(t: int) -> None:
        after_step(t)
        if outer.steps_at(t):
            dump(f"outer{t}")

    def take() -> None:
        dump("local_end")
        take_final()
        dump("final")

    outer.after_step, outer.take_final = after, take
    return outer


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    train(config, env, outer_step_factory=dumping_outer_step)
