"""pretrain_gpt.py that records the distributed optimizer's checkpointed state, per rank.

    torchrun ... tests/optimizer_state_dump.py DUMP_DIR <pretrain_gpt.py flags>

At every torch_dist save, ``DUMP_DIR/save_rank{R}.pt`` gets this rank's own slices of the
fp32 main params and Adam moments (by model key, with the slice's [start, end) in the
flattened param), the bytes of optimizer-state tensors handed to the checkpoint writer,
the rank's own optimizer-state bytes and the bucket count; after a torch_dist load,
``DUMP_DIR/load_rank{R}.pt`` gets the slices read back.
"""

import pathlib
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.checkpoint import dist_optimizer, model_space
from loco_megatron.cli import main_config
from loco_megatron.training.trainer import train


def _slices(opt, keys: dict) -> dict:
    out = {}
    for param, start, end in dist_optimizer.owned_slices(opt):
        tensors = dist_optimizer.state_tensors(opt, param)
        out[keys[param]] = (start, end, param.numel(), {k: v.clone() for k, v in tensors.items()})
    return out


def _writer_bytes(sd: dict) -> int:
    """Bytes of memory the optimizer-state tensors in ``sd`` cover (the union of their
    ranges: views of the live state count what they show, not the buffer behind them)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    spans = sorted((sh.data.data_ptr(), sh.data.data_ptr() + sh.data.numel() * sh.data.element_size())
                   for sh in nested_values(sd["params"]))
    total, end = 0, None
    for a, b in spans:
        if end is None or a >= end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def main(dump: pathlib.Path, argv: list) -> None:
    keys = {}  # model param -> its checkpoint key (known from the model's sharded state dict)
    original_sd, original_load = dist_optimizer.sharded_state_dict, dist_optimizer.load_state_dict

    def sharded_state_dict(opt, model_sd, is_loading):
        sd = original_sd(opt, model_sd, is_loading)
        # Stacked layers share a key: the first part's global offset tells them apart.
        keys.update({p: f"{sh.key}@{model_space.sharded_parts(sh)[0][0].global_offset}"
                     for p, sh in model_space.model_tensors(model_sd).items()})
        if not is_loading:
            torch.save({"slices": _slices(opt, keys), "writer_bytes": _writer_bytes(sd),
                        "own_bytes": dist_optimizer.own_state_bytes(opt),
                        "buckets": sum(len(b.buckets) for b in opt.buffers)},
                       dump / f"save_rank{dist.get_rank()}.pt")
        return sd

    def load_state_dict(opt, sd):
        original_load(opt, sd)
        torch.save({"slices": _slices(opt, keys)}, dump / f"load_rank{dist.get_rank()}.pt")

    dist_optimizer.sharded_state_dict, dist_optimizer.load_state_dict = sharded_state_dict, load_state_dict
    config, env = main_config(argv)
    train(config, env)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(pathlib.Path(sys.argv[1]), sys.argv[2:])
