"""A CPU stand-in for Transformer Engine's ``FusedAdam``, as megatron-core uses it when TE is
installed (``megatron.core.optimizer.Adam``), for the checkpoint tests: its step
bookkeeping, not its kernel.

What it shares with TE's (``transformer_engine/pytorch/optimizers/fused_adam.py``):

* the step count lives in the param group (``param_groups[i]["step"]``, absent before
  the group's first step), not in each parameter's state;
* a group without parameters is skipped before its count advances (TE before its fix
  that advances it anyway): under megatron-core's layer-wise optimizer a rank owning
  nothing of a group keeps no count for it;
* a parameter's state holds only ``exp_avg`` and ``exp_avg_sq`` (``master_param`` where TE
  keeps master weights), and ``state_dict()`` looks each entry up in its table of state
  dtypes: any other entry (a per-parameter ``step``) raises ``KeyError``, as TE's
  ``get_unscaled_state`` does.

The update is Adam's (decoupled weight decay with ``adam_w_mode``), in torch.
"""

from __future__ import annotations

import math

import torch

STATE_DTYPES = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}
"""The per-parameter state entries there are (TE's ``name_to_dtype_map``)."""


class GroupStepAdam(torch.optim.Optimizer):
    """Adam whose step count is per param group; megatron-core's keyword arguments."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adam_w_mode: bool = True):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue  # (before the count: an empty group's count stays where it is)
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            lr, wd, step = group["lr"], group["weight_decay"], group["step"]
            correction1, correction2 = 1 - beta1 ** step, 1 - beta2 ** step
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                grad = p.grad if self.adam_w_mode else p.grad.add(p, alpha=wd)
                if self.adam_w_mode:
                    p.mul_(1 - lr * wd)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = state["exp_avg_sq"].sqrt().div_(math.sqrt(correction2)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / correction1)

    def state_dict(self) -> dict:
        out = super().state_dict()
        for entries in out["state"].values():
            for name in entries:
                if name not in STATE_DTYPES:  # (TE looks the entry up in its table of dtypes)
                    raise KeyError(name)
        return out


def install() -> None:
    """Make megatron-core's optimizer factory build :class:`GroupStepAdam` where it builds
    Adam, as it builds TE's FusedAdam when TE is installed."""
    import megatron.core.optimizer as factory

    factory.Adam, factory.USING_PYTORCH_OPTIMIZER = GroupStepAdam, False
