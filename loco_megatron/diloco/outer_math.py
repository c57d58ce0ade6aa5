"""The outer step's maths as pure tensor functions (no torch.distributed, no megatron).

All tensors are flat fp32 ``[N]`` shards; every function works in place on its first
argument(s) and returns nothing, so the driver owns every buffer.
"""

from __future__ import annotations

import torch


def outer_gradient(agreed: torch.Tensor, local: torch.Tensor, out: torch.Tensor) -> None:
    """``out = agreed - local``: the outer gradient (pseudo-gradient) of one replica. fp32
    subtraction of two fp32 values is exact when they are within a factor of two of each
    other (Sterbenz), which the parameters of a few inner steps apart are, elementwise,
    almost everywhere; elsewhere it rounds once."""
    torch.sub(agreed, local, out=out)


def nesterov_step(agreed: torch.Tensor, momentum: torch.Tensor | None, mean_grad: torch.Tensor, lr: float,
                  mu: float) -> None:
    """Outer Nesterov SGD (torch.optim.SGD(nesterov=True, dampening=0) order of operations)::

        m      <- mu * m + g
        agreed <- agreed - lr * (g + mu * m)

    ``momentum`` None (``mu == 0``): ``agreed <- agreed - lr * g``. ``mean_grad`` is
    overwritten with the update ``g + mu * m``."""
    if momentum is not None and mu:
        momentum.mul_(mu).add_(mean_grad)
        mean_grad.add_(momentum, alpha=mu)
    agreed.sub_(mean_grad, alpha=lr)


def mix_into(local: torch.Tensor, agreed: torch.Tensor, alpha: float) -> None:
    """``local <- alpha * local + (1 - alpha) * agreed``; ``alpha == 0`` copies (exact), so
    every replica then holds the agreed parameters bit for bit."""
    if alpha == 0.0:
        local.copy_(agreed)
    else:
        local.mul_(alpha).add_(agreed, alpha=1.0 - alpha)


def eager_correction(out: torch.Tensor, sent: torch.Tensor, sent_weight: float, payload: torch.Tensor,
                     weight: float) -> None:
    """Eager updates (Kale et al., arXiv 2502.12996): what a replica adds to the mean of the
    exchange that just arrived to step its own outer parameters, before the mean of its
    latest outer gradient has arrived::

        out = weight * payload - sent_weight * sent

    ``payload``: what it sends now (its fresh outer gradient, plus ``sent`` again when no
    exchange of ``sent`` arrived), whose own share (``weight`` = its weight in the mean, 1/R
    for R equal replicas) stands in for the mean still on the wire; ``sent``: what it sent
    last, whose share it applied ahead (with ``sent_weight``) and now takes back out, as the
    mean that arrived holds it (or, when none did, goes out again in ``payload``). With the
    mean ``g`` arrived, ``g + out`` is the paper's eager outer gradient
    ``g_{k-1} + (d_k - d_{k-1}) / R``; ``weight`` 0 is the naive one-interval delay."""
    torch.mul(payload, weight, out=out)
    out.sub_(sent, alpha=sent_weight)
