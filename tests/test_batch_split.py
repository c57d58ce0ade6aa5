"""Elastic DiLoCo's batch split (loco_megatron/diloco/elastic/split.py), its sample streams
(MicroBatchIterator shares) and its flags, in one process."""

from __future__ import annotations

import pytest
import torch

from loco_megatron.diloco.elastic.split import (MIN_GAIN, Member, Share, fixed_share, held_by_all, idle_share,
                                                mean_factors, next_split, split, split_id)


def test_a_split_is_proportional_whole_granules_and_covers_the_batch_once():
    """Guards against shares that overlap, leave a gap, are not whole micro batches on
    every data-parallel rank, starve a slow replica of any share, or depend on the order
    the fingerprints arrived in (the replicas would read different samples)."""
    assert split([0, 1], [2.0, 1.0], 12, 2) == {0: Share(0, 8), 1: Share(8, 4)}
    assert split([1, 0], [1.0, 2.0], 12, 2) == {0: Share(0, 8), 1: Share(8, 4)}
    assert split([0, 1], [100.0, 1.0], 12, 2) == {0: Share(0, 10), 1: Share(10, 2)}  # one granule at least
    for rates in ([1.0, 1.0, 1.0], [3.0, 1.0, 1.0], [0.3, 5.0, 2.2], [1.0, 1.0, 1e-9]):
        for granule, gbs in ((2, 12), (4, 48), (1, 7)):
            shares = split([5, 2, 9], rates, gbs, granule)
            spans = sorted((s.offset, s.offset + s.samples) for s in shares.values())
            assert spans[0][0] == 0 and spans[-1][1] == gbs and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all(s.samples % granule == 0 and s.samples >= granule for s in shares.values())
            assert [shares[r].offset for r in (2, 5, 9)] == sorted(s.offset for s in shares.values())  # by replica id
    assert split([0, 1, 2], [1.0, 1.0, 1.0], 12, 2) == {r: fixed_share(r, 3, 12) for r in range(3)}
    with pytest.raises(ValueError):
        split([0, 1, 2], [1.0, 1.0, 1.0], 4, 2)


def _holding(shares: dict[int, Share], speeds: dict = None, weights: dict = None, granules: dict = None) -> list:
    """Members that hold ``shares`` (one split, :func:`split_id` and each its share)."""
    ident = split_id(shares)
    return [Member(r, s.samples, (speeds or {}).get(r, 0.0), (weights or {}).get(r, 1), (granules or {}).get(r, 1),
                   ident) for r, s in shares.items()]


def test_the_split_changes_when_replicas_come_or_go_and_when_speeds_pay_for_it():
    """Guards against a dead replica's share left unassigned (its samples skipped every
    step), a new replica given nothing, shares that churn on measurement noise, and an
    unmeasured replica (just joined) counted as infinitely slow or fast."""
    assert next_split("fixed", [Member(0, 6, 1.0, 1), Member(1, 0, 0.0, 1)], 12) is None
    # replica 1 left: the survivor's 6 no longer cover 12
    assert next_split("weight", _holding({0: Share(0, 6)}, weights={0: 2}), 12) == {0: Share(0, 12)}
    # replica 2 joins (no share): the weights split the batch among all
    assert next_split("weight", [*_holding({0: Share(0, 12)}, weights={0: 2}), Member(2, 0, 0.0, 1)], 12) == \
        {0: Share(0, 8), 2: Share(8, 4)}
    assert next_split("weight", _holding({0: Share(0, 8), 2: Share(8, 4)}, weights={0: 2}), 12) is None
    # throughput: 2x faster replica 0, equal shares: a re-split removes half a step of idling
    equal = {0: Share(0, 6), 1: Share(6, 6)}
    assert next_split("throughput", _holding(equal, speeds={0: 40.0, 1: 20.0}), 12) == {0: Share(0, 8),
                                                                                          1: Share(8, 4)}
    # noise around the right split: kept
    right = {0: Share(0, 8), 1: Share(8, 4)}
    assert next_split("throughput", _holding(right, speeds={0: 41.0, 1: 19.0}), 12) is None
    near = _holding(equal, speeds={0: 20.0 * (1 + MIN_GAIN / 2), 1: 20.0})
    assert idle_share([6, 6], [m.speed for m in near]) < MIN_GAIN and next_split("throughput", near, 12) is None
    # a joiner not measured yet counts at the measured mean
    assert next_split("throughput", [*_holding({0: Share(0, 12)}, speeds={0: 30.0}), Member(1, 0, 0.0, 1)], 12) == \
        {0: Share(0, 6), 1: Share(6, 6)}
    # replicas of other layouts: shares in whole steps of both (DP 2 x micro 2 and DP 1 x micro 2)
    assert next_split("weight", [Member(0, 0, 0.0, 1, granule=4), Member(1, 0, 0.0, 2, granule=2)], 12) == \
        {0: Share(0, 4), 1: Share(4, 8)}
    with pytest.raises(ValueError, match="do not split --global-batch-size 12"):
        next_split("weight", [Member(0, 0, 0.0, 1, granule=8), Member(1, 0, 0.0, 1, granule=2)], 12)
    # nobody measured (a whole-run restart): the weights
    assert next_split("throughput", [Member(0, 0, 0.0, 3), Member(1, 0, 0.0, 1)], 16) == {0: Share(0, 12),
                                                                                             1: Share(12, 4)}


def test_shares_of_another_split_are_never_kept():
    """Guards against the stale-share bug of a replica returning with the share of a split
    it missed: weights 2/1/1 at global batch 16, A holds 0-7 and misses a quorum, B and C
    re-split to 0-7 and 8-15, C dies, A returns (healed or not) with 0-7: the shares of A and
    B (0-7 and 0-7) sum to the batch, so a test by sizes alone kept them, A and B trained
    0-7 twice and 8-15 was skipped. Shares of two splits (or of one made for other
    replicas) always split again."""
    weights = {0: 2, 1: 1, 2: 1}
    abc = split([0, 1, 2], [2, 1, 1], 16, 1)
    assert abc == {0: Share(0, 8), 1: Share(8, 4), 2: Share(12, 4)}
    bc = next_split("weight", [m for m in _holding(abc, weights=weights) if m.replica != 0], 16)
    assert bc == {1: Share(0, 8), 2: Share(8, 8)}
    a_stale = _holding(abc, weights=weights)[0]
    b_now = _holding(bc, weights=weights)[0]
    assert a_stale.samples + b_now.samples == 16  # (what the size test was fooled by)
    assert next_split("weight", [a_stale, b_now], 16) == {0: Share(0, 11), 1: Share(11, 5)}
    # A healed from B takes B's split, in which it has no share: split again as well
    assert next_split("weight", [Member(0, 0, 0.0, 2, 1, split_id(bc)), b_now], 16) == {0: Share(0, 11),
                                                                                          1: Share(11, 5)}
    assert held_by_all(_holding(bc), 16) and not held_by_all([a_stale, b_now], 16)


def test_a_share_its_holders_layout_cannot_train_is_split_again():
    """Guards against a split kept for a replica healed or restarted in another layout: it
    held 6 of 12 samples at TP 2 (granule 2) and comes back at DP 2 (granule 4) with the
    same split as its peer; a test of ids and sums alone kept the split, and its heal was
    refused at every try (6 samples are not whole micro batches on 2 ranks) until the
    quorum timeout ended it. The split is made again in whole shares of both granules."""
    halves = split([0, 1], [1, 1], 12, 2)
    assert halves == {0: Share(0, 6), 1: Share(6, 6)}
    assert held_by_all(_holding(halves, granules={0: 2}), 12)
    moved = _holding(halves, granules={0: 4})
    assert not held_by_all(moved, 12)
    assert next_split("weight", moved, 12) == {0: Share(0, 8), 1: Share(8, 4)}  # (whole shares of lcm(4, 1))


def test_the_outer_mean_is_weighted_by_the_samples_each_replica_trained():
    """Guards against an outer step that averages replicas of unequal shares as equals (a
    replica that trained a third of the samples would pull half of the update) and against
    a factor that is not exactly 1 for equal shares (the fixed split's exchange would no
    longer be bit for bit the same as before the split existed)."""
    torch.manual_seed(0)
    samples = {0: 8, 3: 4, 5: 2}
    deltas = {r: torch.randn(64, dtype=torch.float64) for r in samples}
    factors = mean_factors(samples)
    channel_mean = sum(factors[r] * deltas[r] for r in samples) / len(samples)  # what the exchange computes
    weighted = sum(samples[r] * deltas[r] for r in samples) / sum(samples.values())
    assert torch.allclose(channel_mean, weighted, rtol=0, atol=1e-12)
    assert mean_factors({0: 4, 1: 4, 2: 4}) == {0: 1.0, 1: 1.0, 2: 1.0}
    assert mean_factors({0: 6, 1: 0}) == {0: 2.0, 1: 0.0}  # a contributor with no share yet adds nothing


def test_replica_streams_are_disjoint_and_cover_every_step_across_share_changes():
    """Guards against a replica's data ranks reading outside its share, two replicas reading
    the same sample, or a share change mid-run shifting the stream (samples trained twice
    or skipped): every step owns one global batch, and the shares of that step tile it."""
    from loco_megatron.data.dataset import MicroBatchIterator

    data = [{"x": torch.tensor([i])} for i in range(1000)]
    gbs, mbs = 12, 2
    # replica A: 2 data-parallel ranks; replica B: 1 rank
    a = [MicroBatchIterator(data, gbs, mbs, r, 2, share=(0, 8)) for r in range(2)]
    b = MicroBatchIterator(data, gbs, mbs, 0, 1, share=(8, 4))
    read = []
    for step in range(6):
        if step == 3:  # the replicas re-split at an outer step
            for it in a:
                it.set_share(0, 4)
            b.set_share(4, 8)
        got = [int(mb["x"][i]) for it in (*a, b) for mb in it.step() for i in range(mbs)]
        assert sorted(got) == list(range(step * gbs, (step + 1) * gbs)), (step, got)
        read += got
    assert len(read) == len(set(read)) == 6 * gbs
    assert a[0].num_microbatches == 1 and b.num_microbatches == 4
    with pytest.raises(ValueError):
        b.set_share(6, 8)  # past the batch
    with pytest.raises(ValueError):
        a[0].set_share(0, 6)  # 3 rows per data rank is not whole micro batches of 2


@pytest.mark.parametrize("argv, message", [
    (["--diloco-replicas", "2", "--diloco-batch-split", "weight"],
     "--diloco-batch-split: weight needs --diloco-lighthouse"),
    (["--diloco-replicas", "2", "--diloco-lighthouse", "http://h:1", "--diloco-replica-id", "0",
      "--diloco-replica-weight", "2"], "--diloco-replica-weight: needs --diloco-batch-split weight or throughput"),
    (["--diloco-replicas", "2", "--diloco-lighthouse", "http://h:1", "--diloco-replica-id", "0",
      "--diloco-batch-split", "weight", "--diloco-replica-weight", "0"], "--diloco-replica-weight: 0.0 is not > 0"),
    (["--diloco-replicas", "3", "--diloco-lighthouse", "http://h:1", "--diloco-replica-id", "0",
      "--diloco-batch-split", "throughput", "--global-batch-size", "4", "--micro-batch-size", "2"],
     "--global-batch-size: 4 is not a multiple of 2 samples"),
    (["--diloco-replicas", "2", "--diloco-lighthouse", "http://h:1", "--diloco-replica-id", "0",
      "--diloco-quorum-timeout-s", "5"], "--diloco-quorum-timeout-s: 5 s is below 10 s: a replica that dies would "
                                         "end the run"),
])
def test_bad_batch_split_flags_are_one_line(argv, message):
    """Guards against a split asked of a one-job run (its replicas are one world and must be
    equal), a weight that the fixed split would silently ignore, a zero weight, a global
    batch too small to give every replica a share, and a quorum timeout that the first
    death would run out (issue 55: timeouts that cannot work together): each is one line
    naming the flag."""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError

    with pytest.raises(ConfigError) as e:
        config = parse_config(argv)
        config.data_parallel_size(1)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
