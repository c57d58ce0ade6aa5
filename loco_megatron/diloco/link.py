"""What the link between replicas must carry: how long one outer exchange takes against the
outer interval's compute (pure arithmetic; ``--dry-run`` with --diloco-link-gbps, and the
table of docs/diloco.md, ``benchmarks/link_needs.py``).

One outer exchange sends, per parameter and over a replica's link (all its ranks
together), what both halves of the exchange put on the wire: ``2 (R - 1) / R`` rows of
``b`` bits and one fp32 scale per block (LoCo's ``b``-bit exchange), or of 32 bits (the
fp32 all-reduce). The interval computes ``H x tokens per step x FLOPs per token`` at the
replica's FLOP/s. With ``FLOPs per token = 6 N`` the model size cancels::

    exchange / interval = bits per parameter x replica FLOP/s / (6 x H x tokens per step x link bit/s)

Lockstep DiLoCo waits that fraction on top of its compute at every outer step; eager
updates (--diloco-eager) hide it while it stays below one interval.
"""

from __future__ import annotations

ASSUMED_MFU = 0.4
"""The model FLOPs utilisation a projection assumes (a dry run measures nothing)."""
ASSUMED_GPU = "H100"
"""The GPU a dry run's projection assumes (its dense bf16 peak:
:data:`~loco_megatron.training.flops.PEAK_BF16_TFLOPS`)."""


def wire_bits_per_param(outer_bits: int, replicas: int, block_size: int) -> float:
    """Bits one replica's link carries per parameter and outer exchange (both halves)."""
    rows = 2.0 * (replicas - 1) / replicas
    return rows * (32.0 if not outer_bits else outer_bits + 32.0 / block_size)


def exchange_seconds(params: float, bits_per_param: float, link_gbps: float) -> float:
    """Seconds one exchange of ``params`` parameters takes on a link of ``link_gbps`` Gbit/s."""
    return params * bits_per_param / (link_gbps * 1e9)


def interval_seconds(inner_steps: int, tokens_per_step: float, flops_per_token: float, replica_flops: float) -> float:
    """Seconds of compute in one outer interval of a replica (``tokens_per_step``: its own
    share of each step's global batch; ``replica_flops``: its FLOP/s, all GPUs together)."""
    return inner_steps * tokens_per_step * flops_per_token / replica_flops


def exchange_fraction(params: float, bits_per_param: float, link_gbps: float, inner_steps: int,
                      tokens_per_step: float, flops_per_token: float, replica_flops: float) -> float:
    """One exchange's time over the interval's compute (the module docstring)."""
    return (exchange_seconds(params, bits_per_param, link_gbps)
            / interval_seconds(inner_steps, tokens_per_step, flops_per_token, replica_flops))


def describe_link(config, world_size: int, params: int, flops_per_token: float) -> str:
    """The dry run's line for --diloco-link-gbps: one exchange of the model's ``params``
    parameters against one interval of ``flops_per_token`` per token, on the replica's
    GPUs (``world_size`` / replicas in one job; elastic: this job's) at
    :data:`ASSUMED_MFU` of an :data:`ASSUMED_GPU`'s peak."""
    from loco_megatron.training.flops import PEAK_BF16_TFLOPS

    d, lc = config.diloco, config.loco
    gpus = world_size // d.replicas_in_world
    tokens = config.data.global_batch_size * config.model.seq_length / d.diloco_replicas
    peak = PEAK_BF16_TFLOPS[ASSUMED_GPU] * 1e12
    bits = wire_bits_per_param(d.diloco_outer_bits, d.diloco_replicas, lc.loco_block_size)
    wire = exchange_seconds(params, bits, d.diloco_link_gbps)
    compute = interval_seconds(d.diloco_inner_steps, tokens, flops_per_token, gpus * peak * ASSUMED_MFU)
    form = f"{d.diloco_outer_bits}-bit" if d.diloco_outer_bits else "fp32"
    if d.diloco_eager:
        note = "eager updates hide it" if wire <= compute else f"eager updates hide {compute / wire:.0%} of it"
    else:
        note = ("lockstep DiLoCo waits for all of it at each outer step"
                + ("; --diloco-eager would hide it" if wire <= compute else ""))
    return (f"DiLoCo link: one outer exchange ({form}, {bits:.2f} bits per parameter on a replica's link, "
            f"{params * bits / 8 / 2**20:,.1f} MiB) takes {wire:.3g} s at {d.diloco_link_gbps:g} Gbit/s: "
            f"{wire / compute:.2f}x the {compute:.3g} s of compute in an outer interval ({d.diloco_inner_steps} "
            f"steps of {tokens:,.0f} tokens per replica on its {gpus} GPU(s), assuming {ASSUMED_GPU}s at "
            f"{ASSUMED_MFU:.0%} MFU); {note}")
