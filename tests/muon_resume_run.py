"""pretrain_gpt.py --optimizer muon run, saved and resumed in the same processes, for
tests/test_muon_training.py's checkpoint test.

    torchrun ... tests/muon_resume_run.py DUMP_DIR ADAM <pretrain_gpt.py flags, --train-iters 4>

``ADAM``: ``torch`` (megatron-core's AdamW, torch's) or ``te`` (megatron-core building
:class:`te_fused_adam.GroupStepAdam`, Transformer Engine FusedAdam's step bookkeeping, where
it builds Adam). Two runs of the flags, one after the other: ``ref`` saves to
``DUMP_DIR/ck`` every 2 steps (torch_dist); ``resume`` resumes from its step 2 and saves
``DUMP_DIR/ck2`` in ``--ckpt-format torch`` (which hands each optimizer's own
``state_dict()`` to ``torch.save``). When each ends every rank writes
``DUMP_DIR/<run>_rank<R>.pt``: ``params``, the model's parameters by name (fp32 clones);
``groups``, per sub-optimizer and param group, the number of parameters this rank owns of
it and the step count as the optimizer keeps it (the group's ``step``, else the sorted
distinct per-parameter ``step`` values; None where it holds none).
"""

import os
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.loco.hooks import ParamGatherHook
from loco_megatron.training import trainer


def _steps(inner, group: dict):
    if "step" in group:
        return float(group["step"])
    steps = sorted({float(inner.state[p]["step"]) for p in group["params"] if "step" in inner.state.get(p, {})})
    return steps or None


def _run(folder: pathlib.Path, tag: str, argv: list) -> None:
    from megatron.core import parallel_state as ps

    config, env = main_config(argv)
    seen: dict = {}

    def param_sync_factory(chunks, optimizer, loco, stats):
        seen["chunks"], seen["optimizer"] = chunks, optimizer
        return ParamGatherHook(chunks, optimizer, loco, stats)

    def dump_then_teardown() -> None:  # the state as training left it; the next run reuses the processes
        chunks, optimizer = seen["chunks"], seen["optimizer"]
        out = {"params": {f"{i}.{n}": p.detach().float().clone() for i, c in enumerate(chunks)
                          for n, p in c.module.named_parameters()},
               "groups": [[(len(g["params"]), _steps(opt.optimizer, g)) for g in opt.optimizer.param_groups]
                          for opt in optimizer.chained_optimizers]}
        torch.save(out, folder / f"{tag}_rank{dist.get_rank()}.pt")
        ps.destroy_model_parallel()

    trainer.shutdown_distributed = dump_then_teardown
    trainer.train(config, env, param_sync_factory=param_sync_factory)


def main(folder: pathlib.Path, adam: str, argv: list) -> None:
    if adam == "te":
        from te_fused_adam import install  # tests/ is this script's folder

        install()
    try:
        _run(folder, "ref", [*argv, "--save", str(folder / "ck"), "--save-interval", "2"])
        # Resume from step 2: every rank writes the same bytes and renames them into place
        # before it reads them, so no rank can read the 4 the first run left.
        latest = folder / "ck" / "latest_checkpointed_iteration.txt"
        mine = latest.with_name(f"{latest.name}.rank{dist.get_rank()}")
        mine.write_text("2\n")
        os.replace(mine, latest)
        _run(folder, "resume", [*argv, "--load", str(folder / "ck"), "--save", str(folder / "ck2"),
                                "--save-interval", "2", "--ckpt-format", "torch"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
