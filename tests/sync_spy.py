"""pretrain_gpt.py with a spy on host-device synchronisation in LoCo's hot paths.

From the start of step ``SPY_FROM`` (after a warm-up step, so one-time set-up such as
compressors' device constants is done) to the start of the next step, every call of a
host-synchronising tensor operation (``Tensor.item/tolist/cpu/numpy``, ``bool()``,
``float()``, ``int()`` of a tensor, ``torch.cuda.synchronize``) and every tensor made from
Python values (``torch.tensor``, ``torch.as_tensor``: on a GPU a blocking pageable copy)
whose *immediate caller* is code of ``loco_megatron/loco`` or ``loco_megatron/diloco`` is
recorded. The window spans one whole overlapped step: the gradient hooks' compress and
launch, their waits, the optimizer step, the parameter gather's encode, launch and apply.
Megatron's and the trainer's own calls (logging, found-inf) are not LoCo's and are not
counted. Prints ``SYNCS rank=R n=N first=...`` at the end of the window.

On CPU none of these calls blocks; on a GPU each does, which is what
``benchmarks/gpu_check.sh`` checks under ``torch.cuda.set_sync_debug_mode("error")``.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.loco.hooks import GradSyncHook
from loco_megatron.training.trainer import train
from param_identity import OnIteration  # tests/ is this script's folder

SPY_FROM = 2
"""The spied step: step 1 warms up (and, with --loco-warmup-iters 0, already compresses)."""

_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "loco_megatron")
WATCHED = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("loco", "diloco"))


class Spy:
    """Replaces the synchronising entry points with recording wrappers while active."""

    TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
    TORCH_FUNCTIONS = ("tensor", "as_tensor")

    def __init__(self):
        self.hits: list[str] = []
        self._saved: list = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        hits = self.hits

        def spy(*args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(WATCHED):
                hits.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, spy)

    def start(self) -> None:
        for name in self.TENSOR_METHODS:
            self._wrap(torch.Tensor, name)
        for name in self.TORCH_FUNCTIONS:
            self._wrap(torch, name)
        self._wrap(torch.cuda, "synchronize")

    def stop(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []


class SpiedHook(OnIteration, GradSyncHook):
    def __init__(self, chunks, loco, stats):
        self._spy = Spy()
        super().__init__(chunks, loco, stats)

    def on_iteration(self, value: int) -> None:
        if value == SPY_FROM:
            self._spy.start()
        elif value == SPY_FROM + 1:
            self._spy.stop()
            hits = self._spy.hits
            sys.stdout.flush()
            os.write(1, f"SYNCS rank={dist.get_rank()} n={len(hits)} first={hits[:3]}\n".encode())


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    train(config, env, grad_sync_factory=SpiedHook)
