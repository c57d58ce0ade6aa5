"""megatron-core's parameter groups for an optimizer built outside its factories.

--optimizer muon builds its Muon half itself (megatron-core's ``get_megatron_muon_optimizer``
needs the emerging-optimizers package), over the groups megatron's own factories make: the
keys its LR scheduler reads (``max_lr``, ``min_lr``, ``lr_mult``, ``wd_mult``) and the expert
flag its layer-wise optimizer deals by. They come from megatron-core's private
``_get_param_groups``, in the supported version range only.
"""

from __future__ import annotations

from loco_megatron.loco.hooks.version import check_megatron_core_version


def megatron_param_groups(model_chunks: list, config) -> list:
    """megatron-core's parameter groups of the trainable parameters of ``model_chunks``
    under its OptimizerConfig ``config`` (its standard overrides: no weight decay on biases
    and 1-D parameters). Collective (megatron aligns the groups across the ranks)."""
    check_megatron_core_version()
    from megatron.core.optimizer import _get_param_groups

    return _get_param_groups(model_chunks, config, None)
