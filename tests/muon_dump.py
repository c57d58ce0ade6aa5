"""pretrain_gpt.py with the model and --optimizer muon's sharding dumped for
tests/test_muon_training.py.

    torchrun ... tests/muon_dump.py DUMP_DIR TAG <pretrain_gpt.py flags>

When training ends each rank writes ``DUMP_DIR/TAG_rank<R>.pt``: ``params``, the model's
parameters by name (fp32 clones, every chunk); ``owned``, per sub-optimizer the names of the
parameters whose optimizer state this rank holds
(:func:`loco_megatron.loco.hooks.diloco.main_shards`, with each one's start and end);
``dtypes``, each parameter's dtype; ``marks``, per parameter of the Muon sub-optimizer this
rank owns, the ``is_qkv`` and ``expert_tp`` marks its (main) parameter carries; ``muon``, the
names of the parameters in the Muon sub-optimizer's parameter groups (every rank's, before
sharding: :func:`loco_megatron.optimizer.muon_split`).
"""

import pathlib
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.loco.hooks import ParamGatherHook
from loco_megatron.loco.hooks.diloco import main_shards
from loco_megatron.optimizer import muon_split
from loco_megatron.optimizer.layer_wise import owned
from loco_megatron.training.trainer import train


def main(folder: pathlib.Path, tag: str, argv: list) -> None:
    config, env = main_config(argv)
    seen: dict = {}

    def param_sync_factory(chunks, optimizer, loco, stats):
        seen["chunks"], seen["optimizer"] = chunks, optimizer
        seen["muon"] = [n for n, _ in muon_split(chunks)[0]]
        return ParamGatherHook(chunks, optimizer, loco, stats)

    def dump() -> None:
        chunks = seen["chunks"]
        names = {id(p): f"{i}.{n}" for i, c in enumerate(chunks) for n, p in c.module.named_parameters()}
        out = {"params": {names[id(p)]: p.detach().float().clone() for c in chunks for p in c.module.parameters()},
               "owned": [[(names[id(p)], start, end) for p, start, end, _ in pairs]
                         for pairs in main_shards(seen["optimizer"])],
               "muon": seen["muon"],
               "dtypes": {names[id(p)]: str(p.dtype) for c in chunks for p in c.module.parameters()},
               "marks": {names[id(p)]: (getattr(main, "is_qkv", False), getattr(main, "expert_tp", False))
                         for p, main in owned(seen["optimizer"])[0]}}
        torch.save(out, folder / f"{tag}_rank{dist.get_rank()}.pt")

    from loco_megatron.training import trainer

    shutdown = trainer.shutdown_distributed

    def dump_then_shutdown() -> None:  # the model as training left it, before the groups go
        dump()
        shutdown()

    trainer.shutdown_distributed = dump_then_shutdown
    train(config, env, param_sync_factory=param_sync_factory)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
