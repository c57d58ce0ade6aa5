"""DiLoCo's pure parts in one process: the outer maths, the fragment schedule, the
fragment of each parameter, the outer-state memory formula."""

from __future__ import annotations

import pytest
import torch

from loco_megatron.config import Config, ConfigError, DiLoCoConfig
from loco_megatron.diloco.fragments import fragment_of
from loco_megatron.diloco.memory import outer_memory_bytes
from loco_megatron.diloco.outer_math import mix_into, nesterov_step, outer_gradient
from loco_megatron.diloco.schedule import FragmentSchedule


@pytest.mark.parametrize("mu", [0.0, 0.9])
def test_nesterov_step_matches_torch_sgd(mu):
    """Guards against an outer optimizer that is not the Nesterov SGD DiLoCo specifies
    (wrong sign, momentum applied after the update, the plain-momentum variant, the
    momentum buffer not carried across steps): five steps equal torch.optim.SGD(nesterov)
    on the same pseudo-gradients, bit for bit."""
    torch.manual_seed(0)
    agreed = torch.randn(1000)
    ref = torch.nn.Parameter(agreed.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=mu, nesterov=mu > 0)
    momentum = torch.zeros(1000) if mu else None
    for _ in range(5):
        g = torch.randn(1000)
        ref.grad = g.clone()
        opt.step()
        nesterov_step(agreed, momentum, g.clone(), 0.7, mu)
        assert torch.equal(agreed, ref.detach())


def test_outer_gradient_and_mix():
    """Guards against the pseudo-gradient's sign (local - agreed would make the outer step
    climb) and a mixing factor applied the wrong way round: lr 1 without momentum takes the
    replica exactly to its local parameters; alpha 0 copies the agreed parameters exactly,
    alpha 0.5 lands half way."""
    torch.manual_seed(1)
    agreed, local = torch.randn(300), torch.randn(300)
    delta = torch.empty(300)
    outer_gradient(agreed, local, delta)
    new = agreed.clone()
    nesterov_step(new, None, delta.clone(), 1.0, 0.0)
    assert torch.allclose(new, local, atol=1e-6, rtol=0)
    x = local.clone()
    mix_into(x, agreed, 0.0)
    assert torch.equal(x, agreed)
    x = local.clone()
    mix_into(x, agreed, 0.5)
    assert torch.allclose(x, (local + agreed) / 2)


def test_schedule_one_fragment():
    """Guards against the outer step firing at step 0, missing a multiple of H, or a delay
    that applies before it started: F=1 syncs at H, 2H, ...; with tau=0 applies there too,
    with tau=2 two steps later, its second phase one step after the start."""
    s = FragmentSchedule(4)
    assert [t for t in range(1, 13) if s.starts(t)] == [4, 8, 12]
    assert all(s.applies(t) == s.starts(t) for t in range(13))  # tau = 0: applied where it starts
    s = FragmentSchedule(4, 1, 2)
    assert [t for t in range(1, 13) if s.applies(t)] == [6, 10]
    assert [t for t in range(1, 13) if s.second_phase(t)] == [5, 9]
    assert s.in_flight(5) == [(0, 4)] and s.in_flight(6) == []


def test_schedule_streaming_staggers_one_fragment_at_a_time():
    """Guards against fragments that sync at the same step (the bursts Streaming DiLoCo
    spreads out), a fragment synced more or less often than every H steps, or two
    exchanges in flight at once: F=4, H=32, tau=8 (the gap) over 256 steps."""
    s = FragmentSchedule(32, 4, 8)
    starts = {f: [t for t in range(1, 257) if f in s.starts(t)] for f in range(4)}
    assert starts[0][:2] == [8, 40] and starts[3][:2] == [32, 64]
    for f, ts in starts.items():
        assert all(b - a == 32 for a, b in zip(ts, ts[1:])), f
    assert all(len(s.starts(t)) <= 1 for t in range(257))
    assert all(len(s.in_flight(t)) <= 1 for t in range(257))
    for f in range(4):
        assert [t for t in range(1, 257) if f in s.applies(t)] == [t + 8 for t in starts[f] if t + 8 <= 256]


def test_schedule_eager_applies_at_the_next_sync():
    """Guards against an eager exchange applied where it starts (a blocking wait: nothing
    overlapped), more than one interval late, or a second phase that waits for the first at
    the very next step (half the interval is what phase 1 has to cross the link): H 8, F 2:
    fragment 0 syncs at 4, 12, 20, its exchange of 4 is applied at 12 (where 12's starts),
    the second phase runs 4 steps after each start, and a checkpoint at any step after a
    fragment's first sync carries that fragment's latest exchange."""
    s = FragmentSchedule(8, 2, 0, True)
    assert [t for t in range(1, 25) if 0 in s.starts(t)] == [4, 12, 20]
    assert [t for t in range(1, 25) if 0 in s.applies(t)] == [12, 20]
    assert [t for t in range(1, 25) if 0 in s.second_phase(t)] == [8, 16, 24]
    assert all(s.updates(t) == s.starts(t) for t in range(25))  # every sync steps (the first with no mean yet)
    assert s.in_flight(3) == [] and s.in_flight(4) == [(0, 4)] and s.in_flight(9) == [(0, 4), (1, 8)]
    assert s.in_flight(12) == [(1, 8), (0, 12)]
    assert FragmentSchedule(*s.as_list()) == s and FragmentSchedule(8, 2).as_list() == [8, 2, 0]
    assert not FragmentSchedule(1, 1, 0, True).split_phases  # H 1: both phases at the next sync


def test_fragment_of():
    """Guards against layers assigned out of order, the embedding or head in the wrong
    fragment, or a tied output layer (another pipeline stage's copy of the embedding)
    syncing with the last fragment: the two copies would then drift apart."""
    frag = lambda name, layer=None, shared=False: fragment_of(name, layer, shared, 8, 4)  # noqa: E731
    assert frag("embedding.word_embeddings.weight") == 0
    assert [frag("decoder.layers.x.mlp.linear_fc1.weight", layer) for layer in range(1, 9)] == [0, 0, 1, 1, 2, 2,
                                                                                                  3, 3]
    assert frag("decoder.final_layernorm.weight") == 3
    assert frag("output_layer.weight") == 3
    assert frag("output_layer.weight", shared=True) == 0
    with pytest.raises(ValueError):
        frag("decoder.layers.9.x", 9)


@pytest.mark.parametrize("flags, message", [
    ({"diloco_sync_delay": 9, "diloco_inner_steps": 32, "diloco_fragments": 4}, "--diloco-sync-delay: 9"),
    ({"diloco_fragments": 5, "diloco_inner_steps": 4}, "--diloco-fragments: 5"),
    ({"diloco_outer_bits": 3}, "--diloco-outer-bits: 3 is not one of"),
    ({"diloco_outer_momentum": 1.0}, "--diloco-outer-momentum"),
    ({"diloco_mixing_factor": 1.0, "diloco_sync_delay": 1}, "--diloco-mixing-factor"),
    # alpha > 0 without a delay: the replicas would never agree again
    ({"diloco_mixing_factor": 0.5}, "--diloco-mixing-factor: 0.5 needs --diloco-sync-delay > 0"),
    # fragments that would sync unevenly (4 // 3 steps apart, then 2)
    ({"diloco_fragments": 3, "diloco_inner_steps": 4}, "--diloco-fragments: 3 does not divide --diloco-inner-steps 4"),
])
def test_bad_diloco_values_name_the_flag(flags, message):
    """Guards against a bad DiLoCo value crashing later (or silently running: a mixing
    factor with no delay, fragments that do not divide H) instead of a one-line error that
    names its flag."""
    with pytest.raises(ConfigError, match=message):
        DiLoCoConfig(diloco_replicas=2, **flags)


def test_outer_form_defaults_follow_the_width():
    """Guards against --diloco-outer-bits 2 running another form than the one measured best
    at 2 bits (gain-corrected scales, classic error feedback), against 4 and 8 bits losing
    theirs (the moving average, beta 0.8, plain scales), and against explicit flags being
    overridden by the width's default."""
    from loco_megatron.cli import parse_config

    def form(*flags: str) -> tuple:
        d = parse_config(["--diloco-replicas", "2", *flags]).diloco
        return d.diloco_outer_beta, d.diloco_outer_gain_correction

    assert form() == form("--diloco-outer-bits", "8") == (0.8, False)
    assert form("--diloco-outer-bits", "2") == (0.0, True)
    assert form("--diloco-outer-bits", "2", "--diloco-outer-beta", "0.8", "--no-diloco-outer-gain-correction") == \
        (0.8, False)
    assert form("--diloco-outer-bits", "4", "--diloco-outer-gain-correction") == (0.8, True)


def test_sparse_outer_defaults_and_refusals():
    """Guards against --diloco-outer-topk running with the dense form's defaults (4-bit
    values, Nesterov momentum 0.9 on top of the error buffer, the dense LR and beta) instead
    of SparseLoCo's reference settings (2-bit, SGD at LR 1, beta 0.95), explicit flags being
    overridden, and bad combinations (a chunk without top-k, k above the chunk, LoCo's gain
    correction) running instead of a one-line error naming the flag."""
    from loco_megatron.cli import parse_config

    def form(*flags: str) -> tuple:
        d = parse_config(["--diloco-replicas", "2", *flags]).diloco
        return (d.diloco_outer_bits, d.diloco_outer_lr, d.diloco_outer_momentum, d.diloco_outer_beta,
                d.diloco_outer_gain_correction)

    assert form("--diloco-outer-topk", "64") == (2, 1.0, 0.0, 0.95, False)
    assert form("--diloco-outer-topk", "64", "--diloco-outer-bits", "0", "--diloco-outer-momentum", "0.5",
                "--diloco-outer-lr", "0.7", "--diloco-outer-beta", "0.9") == (0, 0.7, 0.5, 0.9, False)
    assert form() == (4, 0.55, 0.9, 0.8, False)  # (dense: as before)
    for flags, message in [({"diloco_outer_chunk": 1024}, "--diloco-outer-chunk: needs --diloco-outer-topk"),
                           ({"diloco_outer_topk": 65, "diloco_outer_chunk": 64}, "--diloco-outer-topk: 65 is more"),
                           ({"diloco_outer_topk": -1}, "--diloco-outer-topk: -1 is not >= 0"),
                           ({"diloco_outer_topk": 4, "diloco_outer_chunk": 1}, "--diloco-outer-chunk: 1 is not >= 2"),
                           ({"diloco_outer_topk": 64, "diloco_outer_gain_correction": True},
                            "--diloco-outer-gain-correction: refits LoCo's block scales")]:
        with pytest.raises(ConfigError, match=message):
            DiLoCoConfig(diloco_replicas=2, **flags)


def test_more_fragments_than_layers_is_one_line():
    """Guards against --diloco-fragments above the layer count being accepted (fragments
    of no layer at all, whose sync steps send nothing but the embedding or nothing)."""
    from loco_megatron.config import ModelConfig

    with pytest.raises(ConfigError, match="--diloco-fragments: 8 is more than the model's 2 transformer layers"):
        Config(model=ModelConfig(num_layers=2), diloco=DiLoCoConfig(diloco_replicas=2, diloco_fragments=8))
    Config(model=ModelConfig(num_layers=2), diloco=DiLoCoConfig(diloco_replicas=2, diloco_fragments=2))


def test_diloco_refuses_what_it_cannot_run():
    """Guards against DiLoCo starting under Megatron-FSDP or without the distributed
    optimizer (its outer step works on the distributed optimizer's shards)."""
    from loco_megatron.config import ParallelConfig

    with pytest.raises(ConfigError, match="--diloco-replicas: needs --use-distributed-optimizer"):
        Config(parallel=ParallelConfig(use_distributed_optimizer=False), diloco=DiLoCoConfig(diloco_replicas=2))
    with pytest.raises(ConfigError, match="--diloco-replicas: is not supported with --use-megatron-fsdp"):
        Config(parallel=ParallelConfig(use_megatron_fsdp=True), diloco=DiLoCoConfig(diloco_replicas=2))


def test_outer_memory_formula():
    """Guards against a dry-run memory estimate that leaves out the outer state or counts
    it without the optimizer's sharding: 4 B agreed + 4 B momentum + 4/F B in flight + the
    two int8 error buffers per element of the rank's shard; nothing without DiLoCo; eager
    updates: every fragment in flight and the own parameters, momentum and sent gradient."""
    cfg = Config(diloco=DiLoCoConfig(diloco_replicas=2, diloco_fragments=4))
    per = 4 + 4 + 1 + (1 + 4 / 256) * 1.5
    assert outer_memory_bytes(cfg, 1000) == pytest.approx(per * 1000)
    assert outer_memory_bytes(Config(), 1000) == 0
    eager = Config(diloco=DiLoCoConfig(diloco_replicas=2, diloco_fragments=4, diloco_eager=True))
    assert outer_memory_bytes(eager, 1000) == pytest.approx((per + 3 + 4 + 4 + 4) * 1000)


def test_link_projection_formula():
    """Guards against a projection of the link's load that counts one half of the exchange,
    forgets the block scales or the (R - 1) / R of a ring, or depends on the model size
    (it must cancel out with 6 FLOPs per parameter and token): the bits per parameter of
    each form, and the exchange fraction of 64 H100s at 40% MFU, 1M tokens per step, H 32,
    4-bit outer over 1 Gbit/s computed from first principles, the same for a 1B and a 70B
    model; and the table benchmarks/link_needs.py prints for the docs."""
    import subprocess
    import sys

    from conftest import REPO
    from loco_megatron.diloco.link import exchange_fraction, wire_bits_per_param
    from loco_megatron.training.flops import PEAK_BF16_TFLOPS

    assert wire_bits_per_param(0, 2, 256) == 32.0
    assert wire_bits_per_param(0, 3, 256) == pytest.approx(2 * 2 / 3 * 32)
    assert wire_bits_per_param(4, 2, 256) == 4 + 32 / 256
    site = 64 * PEAK_BF16_TFLOPS["H100"] * 1e12 * 0.4
    seconds_wire = 1e9 * (4 + 32 / 256) / 1e9  # a 1B model over 1 Gbit/s
    seconds_compute = 32 * 2**20 * 6e9 / site
    for n in (1e9, 70e9):
        got = exchange_fraction(n, wire_bits_per_param(4, 2, 256), 1.0, 32, 2**20, 6 * n, site)
        assert got == pytest.approx(seconds_wire / seconds_compute, rel=1e-12), n
    out = subprocess.run([sys.executable, "benchmarks/link_needs.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 64 GPUs, 1M | 32 | LoCo 4-bit |"))
    assert row.split(" | ")[4] == f"{seconds_wire / seconds_compute:.2f}", row
