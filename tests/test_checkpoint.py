"""torch_dist checkpoints: resharding across layouts, data position, LoCo state, async save,
crash before commit, corrupt shards, model-shape mismatch."""


import pytest
import torch

from conftest import TINY, finished_run, torchrun, torchrun_runs, train_losses

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


RESHARDS = {
    "dp2-to-dp4": (2, [], 4, []),
    "dp4-to-dp2": (4, [], 2, []),
    "tp2xdp2-to-dp4": (4, ["--tensor-model-parallel-size", "2"], 4, []),
    "pp2xdp2-to-dp4": (4, ["--pipeline-model-parallel-size", "2"], 4, []),
    "ep2-to-ep1": (2, MOE + ["--expert-model-parallel-size", "2"], 2, MOE),
}
"""id -> (ranks, flags) of the saving run, (ranks, flags) of the resumed run."""
RESHARD_ARGS = TINY + ["--lr-decay-iters", "6", "--lr", "0.003"]


@pytest.fixture(scope="module")
def reshard_saves(cache_dir, tmp_path_factory) -> dict:
    """{id: (checkpoint folder, the saving run's metrics)}: the saving runs of RESHARDS,
    those of one world size in one torchrun (:func:`conftest.torchrun_runs`); the resumes
    run in fresh processes (a resume must not lean on anything the saving process holds)."""
    out = {}
    for nproc in (2, 4):
        tmp = tmp_path_factory.mktemp(f"reshard_saves{nproc}")
        runs = [(key.replace("-", "_"), save_args + ["--train-iters", "4", "--save", str(tmp / key),
                                                     "--save-interval", "2"])
                for key, (save_n, save_args, _, _) in RESHARDS.items() if save_n == nproc]
        launch = torchrun_runs(nproc, RESHARD_ARGS, cache_dir, tmp, runs)
        for name, _ in runs:
            out[name.replace("_", "-")] = (tmp / name.replace("_", "-"), finished_run(launch, runs, name)[1])
    return out


@pytest.mark.parametrize("key", list(RESHARDS))
def test_checkpoint_reshards_to_another_layout(key, reshard_saves, cache_dir, tmp_path):
    """Guards against checkpoints that only load under the layout they were written with
    (model, distributed-optimizer moments, schedule or data position wrong after a change
    of DP/TP/PP/EP), and against a silent reset of the per-rank state: the resumed run's
    first losses equal the uninterrupted run's, training goes on falling, one line says
    that RNG and LoCo state start fresh."""
    _, _, load_n, load_args = RESHARDS[key]
    ck, ref = reshard_saves[key]
    (ck / "latest_checkpointed_iteration.txt").write_text("2\n")  # resume from iteration 2
    proc, resumed = torchrun(load_n, RESHARD_ARGS + load_args + ["--train-iters", "6", "--load", str(ck)], cache_dir,
                             tmp_path, name="resumed")
    a, b = train_losses(ref), train_losses(resumed)
    assert sorted(b) == [3, 4, 5, 6]
    assert b[3] == pytest.approx(a[3], rel=1e-5), (a, b)  # same weights, same global batch
    assert b[4] == pytest.approx(a[4], rel=1e-4), (a, b)  # same Adam moments and LR
    assert b[6] < a[1] - 0.05, (a, b)
    assert proc.stdout.count("RNG re-seeded and LoCo error buffers") == 1, proc.stdout[-2000:]


def test_data_position_is_global_across_dp_sizes():
    """Guards against a data position that depends on the DP layout: after 2 steps under
    DP2 the DP4 ranks together read exactly the next global batch (none repeated or skipped)."""
    from loco_megatron.data.dataset import MicroBatchIterator

    data = [{"tokens": torch.tensor([i])} for i in range(64)]
    first = [MicroBatchIterator(data, 8, 2, r, 2) for r in range(2)]
    seen = [int(t) for _ in range(2) for it in first for mb in it.step() for t in mb["tokens"]]
    state = first[0].state_dict()
    assert state == first[1].state_dict()
    second = [MicroBatchIterator(data, 8, 1, r, 4) for r in range(4)]
    for it in second:
        it.load_state_dict(state)
    nxt = [int(t) for it in second for mb in it.step() for t in mb["tokens"]]
    assert sorted(seen) == list(range(16)) and sorted(nxt) == list(range(16, 24))


def test_same_layout_resume_with_loco_and_async_save_is_bit_exact(cache_dir, tmp_path):
    """Guards against LoCo's error buffers (or any state) missing from torch_dist
    checkpoints, an --async-save that blocks the training loop until the write is done, and
    a final async save not waited for before exit: losses bit-exact after resume; the
    write of the checkpoint of step 2 is reported complete only after step 3 finished."""
    args = TINY + ["--train-iters", "6", "--lr-decay-iters", "6", "--loco-bits", "4", "--loco-reset-interval", "3"]
    ck = tmp_path / "ck"
    # The uninterrupted run is the one saving (one run fewer); it continues past the saves.
    _, first = torchrun(2, args + ["--save", str(ck), "--save-interval", "2", "--async-save"], cache_dir, tmp_path,
                        name="first")
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "6"  # final save waited for
    (ck / "latest_checkpointed_iteration.txt").write_text("4\n")  # resume from iteration 4
    proc, resumed = torchrun(2, args + ["--load", str(ck)], cache_dir, tmp_path, name="resumed")
    assert "RNG re-seeded" not in proc.stdout
    a, b = train_losses(first), train_losses(resumed)
    assert sorted(b) == [5, 6] and all(a[it] == b[it] for it in b), (a, b)
    order = [(m["iteration"], "write" if "ckpt/write_s" in m else "step")
             for m in first if "ckpt/write_s" in m and m["ckpt/iteration"] == 2 or "train/lm_loss" in m]
    assert order.index((3, "step")) < [kind for _, kind in order].index("write"), order
    blocked = [m for m in first if "ckpt/blocking_s" in m]
    assert [m["ckpt/iteration"] for m in blocked] == [2, 4, 6]


class _Weights:
    """A stand-in model: one sharded tensor (the checkpoint plumbing does not care)."""

    def __init__(self, value: float):
        self.w = torch.full((4, 3), value)

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        return {"model": {"w": ShardedTensor.from_rank_offsets("w", self.w, replica_id=0)}}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        self.w.copy_(loaded["model"]["w"])


def test_async_crash_before_commit_corrupt_shard_and_other_model(tmp_path, monkeypatch):
    """Guards against a crash between an async write and its commit leaving no loadable
    checkpoint (or a half-written one picked by --load), a corrupt torch_dist shard
    loading silently or as a traceback, a checkpoint of another model shape loading,
    and against breaking the export contract ("model" and common "config" keys)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from loco_megatron.checkpoint import Checkpointer, checkpointer
    from loco_megatron.config import ConfigError
    from loco_megatron.platform import detect_platform, platform_context

    layout = {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "model": [2, 64, 4096, None]}
    root = tmp_path / "ck"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with platform_context(detect_platform(0)):
            ck = Checkpointer(str(root), None, 0, layout, ckpt_format="torch_dist", async_save=True,
                              run_config={"model": {"num_layers": 2}})
            ck.save(1, {"model": _Weights(1.0)})
            assert not (root / "iter_0000001").exists()  # handed over, not waited for
            ck.wait()
            assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
            assert [sorted(t) for t in ck.take_timings()] == [["ckpt/blocking_s", "ckpt/iteration"],
                                                              ["ckpt/iteration", "ckpt/write_s"]]

            def crash(*_):
                raise RuntimeError("killed between write and commit")

            monkeypatch.setattr(checkpointer, "commit", crash)
            ck.save(2, {"model": _Weights(2.0)})
            with pytest.raises(RuntimeError, match="killed"):
                ck.wait()
            monkeypatch.undo()
            assert (root / "iter_0000002.tmp").is_dir()

            loader = Checkpointer(None, str(root), 0, layout, ckpt_format="torch_dist", log=lambda _: None)
            path = loader.find_resume_dir()
            assert path == root / "iter_0000001"
            weights = _Weights(0.0)
            assert loader.load(path, {"model": weights}) == 1 and torch.all(weights.w == 1.0)
            assert dist_checkpointing.load_common_state_dict(str(path))["config"] == {"model": {"num_layers": 2}}

            other = Checkpointer(None, str(root), 0, {**layout, "model": [4, 64, 4096, None]})
            with pytest.raises(ConfigError, match="another shape") as e:
                other.find_resume_dir()
            assert "\n" not in str(e.value)

            shard = sorted(path.glob("__0_*.distcp"))[0]
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x01
            shard.write_bytes(bytes(data))
            with pytest.raises(ConfigError) as e:
                loader.load(path, {"model": _Weights(0.0)})
            msg = str(e.value)
            assert "\n" not in msg and str(shard) in msg and "corrupt" in msg
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp2_to_dp4_dumps(cache_dir, tmp_path_factory):
    """Per-rank optimizer state saved under DP2 (many small buckets) and read back under DP4."""
    tmp = tmp_path_factory.mktemp("optdump")
    args = TINY + ["--lr-decay-iters", "6", "--train-iters", "2"]
    torchrun(2, [str(tmp)] + args + ["--save", str(tmp / "ck"), "--save-interval", "2"], cache_dir, tmp,
             script="tests/optimizer_state_dump.py", name="save")
    torchrun(4, [str(tmp)] + args + ["--load", str(tmp / "ck")], cache_dir, tmp,
             script="tests/optimizer_state_dump.py", name="load")
    return ([torch.load(tmp / f"save_rank{r}.pt") for r in range(2)],
            [torch.load(tmp / f"load_rank{r}.pt") for r in range(4)])


def _assemble(dumps: list) -> dict:
    """{model key: {state name: whole flattened tensor}} from the ranks' own slices; every
    element must come from exactly one rank."""
    out, covered = {}, {}
    for dump in dumps:
        for key, (start, end, numel, tensors) in dump["slices"].items():
            whole = out.setdefault(key, {k: torch.full((numel,), float("nan")) for k in tensors})
            hits = covered.setdefault(key, torch.zeros(numel, dtype=torch.int32))
            hits[start:end] += 1
            for k, v in tensors.items():
                whole[k][start:end] = v
    for key, hits in covered.items():
        assert torch.all(hits == 1), f"{key}: elements held by {hits.unique().tolist()} ranks"
    return out


def test_optimizer_state_reshards_bit_exact(dp2_to_dp4_dumps):
    """Guards against a reshard that moves the distributed optimizer's state to the wrong
    elements or rounds it (a block mapped at the wrong offset, a bucket's padding counted,
    a slice that crosses a DP shard boundary cut short): the fp32 main params and both Adam
    moments read back under DP4 are bit-identical to those saved under DP2, for
    parameters spread over many buckets and split between DP ranks."""
    saved, loaded = dp2_to_dp4_dumps
    assert saved[0]["buckets"] > 2  # the layout this test is about: several buckets ...
    split = [k for k, (s, e, n, _) in saved[0]["slices"].items() if 0 < e - s < n]
    assert split, "no parameter split between the DP2 ranks"  # ... and a param across shards
    a, b = _assemble(saved), _assemble(loaded)
    assert a.keys() == b.keys()
    for key in a:
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key][name], b[key][name]), (key, name)
        assert a[key]["exp_avg_sq"].abs().sum() > 0, key  # a step ran: the moments are not trivially 0


def test_each_rank_writes_only_its_optimizer_shard(dp2_to_dp4_dumps):
    """Guards against a save that gathers the whole replica's optimizer state onto every
    data-parallel rank (30 B/param peak on each DP2 rank; ~210 GB per rank for a 7B model):
    the optimizer-state tensors a rank hands to the checkpoint writer are no more than its
    own shard (fp32 param + 2 moments of the elements it owns), half the replica at DP2."""
    saved, _ = dp2_to_dp4_dumps
    replica = sum((e - s) * 12 for d in saved for s, e, _, _ in d["slices"].values())
    for dump in saved:
        assert dump["own_bytes"] < replica  # DP2: each rank owns a part of the state
        assert dump["writer_bytes"] <= dump["own_bytes"], (dump["writer_bytes"], dump["own_bytes"], replica)


def test_fsdp_optimizer_state_dict_copies_nothing():
    """Guards against the torch format's Megatron-FSDP optimizer state being cloned on the
    device at every save (parameters and both moments: 12 bytes per local parameter): the
    state dict must hand out the live tensors' storage, which torch.save then copies to the
    host one storage at a time; and it must still hold their values."""
    from types import SimpleNamespace

    from loco_megatron.training.state import FsdpOptimizerState

    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))]
    adam = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    adam.step()
    clones = []
    original = torch.Tensor.clone
    torch.Tensor.clone = lambda t, *a, **k: clones.append(t.numel()) or original(t, *a, **k)
    try:
        (sd,) = FsdpOptimizerState(SimpleNamespace(optimizer=adam)).state_dict()
    finally:
        torch.Tensor.clone = original
    assert clones == []
    for p, saved, state in zip(params, sd["params"], sd["state"]):
        assert saved.data_ptr() == p.data_ptr() and torch.equal(saved, p)
        assert state["exp_avg"].data_ptr() == adam.state[p]["exp_avg"].data_ptr()
