"""The only code that touches megatron-core's private internals (its DDP bucket groups
and the distributed optimizer's step), for the versions in :mod:`.version`:

* :mod:`.grad_sync`: :class:`GradSyncHook`, LoCo in place of each bucket group's
  gradient reduce-scatter (and timing of megatron's own when LoCo is off);
* :mod:`.param_sync`: :class:`ParamGatherHook`, ``--param-gather-bits`` in place of
  each bucket group's parameter all-gather;
* :mod:`.fsdp`: :class:`FsdpGradHook`, LoCo in place of Megatron-FSDP's cross-node (HSDP)
  gradient all-reduce;
* :mod:`.diloco`: DiLoCo's view of the optimizer (its main-parameter shards, the outer
  update run as an optimizer step);
* :mod:`.param_groups`: megatron's parameter groups, for --optimizer muon's Muon;
* :mod:`.version`: the supported megatron-core range, checked loudly by all of them.
"""

from loco_megatron.loco.hooks.fsdp import FsdpGradHook
from loco_megatron.loco.hooks.grad_sync import GradSyncHook
from loco_megatron.loco.hooks.param_sync import ParamGatherHook
from loco_megatron.loco.hooks.version import SUPPORTED_MCORE, UnsupportedMegatronCore, check_megatron_core_version

__all__ = ["FsdpGradHook", "GradSyncHook", "ParamGatherHook", "check_megatron_core_version", "SUPPORTED_MCORE",
           "UnsupportedMegatronCore"]
