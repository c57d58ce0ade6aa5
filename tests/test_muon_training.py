"""--optimizer muon in real training on gloo ranks: which parameter goes to Muon, the
layer-wise sharding over DP 1/2/4, the parameter all-gather across dtypes, a resume under
another optimizer, AdamW's step counts across a resume (torch's AdamW and a stand-in for
Transformer Engine's FusedAdam). Resumes at the same and at another layout: the combination
matrix (test_matrix.py, its ``muon`` cells); Muon inside DiLoCo (MuLoCo): test_diloco.py; the
update maths: test_muon.py."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, read_metrics, run_launch, torchrun, torchrun_command

# (the LR and scale :data:`TRACK` was set for: the default's 64x larger LR drifts more in bf16)
MUON = TINY + ["--train-iters", "4", "--optimizer", "muon", "--lr", "1e-3", "--muon-extra-scale-factor", "0.5"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--position-embedding-type", "learned_absolute", "--bf16",
       "--expert-model-parallel-size", "2"]
"""A model with experts, a router, a learned position table and mixed dtypes (bf16
weights, fp32 norms)."""
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--muon-tp-mode", "duplicated", "--bf16"]
RESHARD = ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "duplicated", "--load"]
"""DP 2's checkpoint resumed at TP 2 (DP 1), Newton-Schulz on whole matrices as at TP 1."""


def _dump(folder, tag: str, world: int) -> list[dict]:
    return [torch.load(folder / f"{tag}_rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """Dumps (tests/muon_dump.py) of the shared runs, by tag: ``one``, ``dp2``, ``dp4``: TINY
    for 4 steps on 1, 2, 4 ranks; ``moe``: :data:`MOE` on 2 ranks (EP 2); ``tp2``: TP 2 with
    sequence parallelism, --muon-tp-mode duplicated, bf16; ``tp2resume``: ``dp2``'s save at
    step 2 resumed at :data:`RESHARD`; and ``ckpt``, the folder ``dp2`` saved to."""
    tmp = tmp_path_factory.mktemp("muon")
    ckpt = tmp / "ckpt"
    for tag, world, extra in (("one", 1, []), ("dp2", 2, ["--save", str(ckpt), "--save-interval", "2"]),
                              ("dp4", 4, []), ("moe", 2, MOE), ("tp2", 2, TP2), ("tp2resume", 2, RESHARD + [str(ckpt)])):
        if tag == "tp2resume":  # (from dp2's save at step 2)
            (ckpt / "latest_checkpointed_iteration.txt").write_text("2\n")
        torchrun(world, [str(tmp), tag, *MUON, *extra], cache_dir, tmp, script="tests/muon_dump.py", name=tag)
    out = {tag: _dump(tmp, tag, w) for tag, w in (("one", 1), ("dp2", 2), ("dp4", 4), ("moe", 2), ("tp2", 2),
                                                  ("tp2resume", 2))}
    out["ckpt"], out["moe_metrics"] = ckpt, read_metrics(tmp / "moe.jsonl")
    return out


def test_muon_takes_the_layers_matrices_and_adamw_the_rest(runs):
    """Guards against Muon getting an embedding, the output layer or a norm (1-D or not a
    hidden matrix: Newton-Schulz makes no sense there), or AdamW keeping a layer's matrix:
    in a MoE model (EP 2) with a learned position table, Muon takes exactly the 2-D weights
    of the transformer layers (attention, each expert's own fc1 and fc2, the router), and
    the dry run's count of them is the run's (the dense ones once, each rank's experts)."""
    from loco_megatron.cli import parse_config
    from loco_megatron.training.memory_estimate import muon_parameter_count

    count = 0
    for rank, dump in enumerate(runs["moe"]):
        muon = {n.removeprefix("module.") for n in dump["muon"]}
        params = {n.split(".", 1)[1]: p for n, p in dump["params"].items()}
        assert muon == {n for n, p in params.items() if n.startswith("decoder.layers.") and p.dim() == 2}
        assert {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", "decoder.layers.1.mlp.router.weight",
                "decoder.layers.0.self_attention.linear_qkv.weight"} <= muon
        assert not any(("embedding" in n or "output_layer" in n or "layernorm" in n) for n in muon)
        count += sum(params[n].numel() for n in muon if ".experts." in n or rank == 0)
    assert count == sum(muon_parameter_count(parse_config([*MUON, *MOE])))


def _names(dump: dict) -> list[str]:
    return [n for pairs in dump["owned"] for n, _, _ in pairs]


def test_layer_wise_sharding_gives_each_parameter_one_owner(runs):
    """Guards against a parameter that no rank steps or that two ranks step, or a rank
    owning part of one (DiLoCo's outer step and the checkpoint read these shards): over DP
    1, 2 and 4 every parameter has exactly one owner, whole, and every rank owns some."""
    for tag, world in (("one", 1), ("dp2", 2), ("dp4", 4)):
        owners = [_names(d) for d in runs[tag]]
        assert sorted(n for names in owners for n in names) == sorted(runs[tag][0]["params"]), tag
        assert all(start == 0 and end == runs[tag][0]["params"][n].numel()
                   for d in runs[tag] for pairs in d["owned"] for n, start, end in pairs)
        assert all(len(names) > 0 for names in owners)


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).pow(2).mean().sqrt().item()


TRACK = 2e-5
"""Per parameter, the RMS difference two runs of the same training may show when their
gradients are summed in another order: Newton-Schulz rounds its input to bf16, so fp32
differences of 1e-7 flip roundings and reach the weights (measured: 4.5e-6 at DP 2, 6.9e-6
at DP 4 against one rank). One Muon step moves a matrix by an RMS of lr x 0.5 (5e-4 at the
peak lr): a step missed, doubled or taken with the wrong momentum is far above it."""


def test_dp_2_and_4_track_one_rank(runs):
    """Guards against the sharded optimizer computing another update than one rank would
    (a parameter stepped twice or not at all, momentum of the wrong parameter, the
    gradients averaged over the wrong ranks): after 4 steps every parameter of DP 2 and DP
    4 is within :data:`TRACK` (RMS) of the one-rank run's, and every rank of a run holds
    the same weights."""
    one = runs["one"][0]["params"]
    for tag in ("dp2", "dp4"):
        for dump in runs[tag]:
            assert all(torch.equal(dump["params"][n], runs[tag][0]["params"][n]) for n in one), tag
        worst = max(_rms(runs[tag][0]["params"][n], one[n]) for n in one)
        assert worst < TRACK, (tag, worst)


def test_bf16_parameters_gather_at_their_own_bytes(runs):
    """Guards against the layer-wise all-gather sending parameters at another dtype than
    their own (megatron-core's gathers every one in the dtype of the first one dealt: bf16
    matrices as fp32, twice their bytes) or leaving the ranks apart: under --bf16 (every
    dense parameter bf16, the norms too, as Megatron-LM's Float16Module builds them) both
    ranks end with the same dense weights, bit for bit, and each step's
    comm/param_bytes_sent is those parameters' own bytes (2 per element; the experts, EP 2,
    are each rank's own and gather nothing): the matrix (test_matrix.py) checks that count
    against what reached the collective. Mixed fp32 and bf16 parameters in one gather:
    test_muon.py."""
    a, b = (d["params"] for d in runs["moe"])
    dense = [n for n in a if ".experts." not in n]
    assert all(torch.equal(a[n], b[n]) for n in dense), [n for n in dense if not torch.equal(a[n], b[n])]
    dtypes = runs["moe"][0]["dtypes"]
    assert {dtypes[n] for n in dense} == {"torch.bfloat16"}
    own = sum(a[n].numel() * (2 if dtypes[n] == "torch.bfloat16" else 4) for n in dense)
    logged = [m["comm/param_bytes_sent"] for m in runs["moe_metrics"] if "comm/param_bytes_sent" in m]
    assert logged and all(x == own for x in logged), (own, logged)


def test_another_optimizer_cannot_resume_a_muon_checkpoint(runs, cache_dir, tmp_path):
    """Guards against a resume that silently mixes optimizers (AdamW starting its moments
    from zero on Muon's checkpoint, or failing deep inside the loader): --optimizer adam on
    a Muon checkpoint is refused in one line naming both, before any step."""
    cmd, env = torchrun_command(2, [*TINY, "--train-iters", "4", "--load", str(runs["ckpt"])], cache_dir,
                                tmp_path / "m.jsonl")
    proc = run_launch(cmd, env, 300)
    errors = {line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")}
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert "was trained with --optimizer muon and this run asks for --optimizer adam" in errors.pop()


def test_bf16_main_parameters_keep_the_marks_muon_reads(runs):
    """Guards against Muon losing the QKV split and the expert TP group under --bf16:
    megatron's Float16 wrapper makes fp32 main parameters without the model parameter's
    ``is_qkv`` and ``expert_tp`` marks, which megatron-core's Muon reads from the parameter it
    steps; every main parameter a rank owns carries its model parameter's marks (the QKV
    matrices ``is_qkv``, the experts' ``expert_tp``)."""
    for tag in ("moe", "tp2"):
        for dump in runs[tag]:
            for name, (qkv, expert) in dump["marks"].items():
                assert qkv == name.endswith("linear_qkv.weight"), (tag, name)
                assert expert == (".experts." in name), (tag, name)
        assert any(q for d in runs[tag] for q, _ in d["marks"].values()), tag
    assert any(e for d in runs["moe"] for _, e in d["marks"].values())


def test_tensor_parallel_duplicated_with_sequence_parallelism(runs):
    """Guards against --muon-tp-mode duplicated under TP 2 with sequence parallelism
    updating the parameters TP replicates differently on the two TP ranks (their gradients
    are reduced over the TP group first; an update that read a rank's own slice only would
    differ) or failing to train: the norms are bit-identical across the TP ranks and the
    weights moved."""
    a, b = (d["params"] for d in runs["tp2"])
    norms = [n for n in a if "layernorm" in n]
    assert norms and all(torch.equal(a[n], b[n]) for n in norms)
    assert any(not torch.equal(a[n], b[n]) for n in a if n.endswith("linear_qkv.weight"))  # (its TP slices)


def _whole(dumps: list, name: str, like: torch.Tensor) -> torch.Tensor:
    """Parameter ``name`` of a TP 2 run put together from its two ranks' slices (megatron's
    layouts: SwiGLU's fc1 holds each rank's gate and up halves), shaped as ``like``."""
    a, b = (d["params"][name] for d in dumps)
    if a.shape == like.shape:
        return a
    if name.endswith("linear_fc1.weight"):
        (ga, ua), (gb, ub) = a.chunk(2), b.chunk(2)
        return torch.cat([ga, gb, ua, ub])
    return torch.cat([a, b], dim=0 if a.shape[1] == like.shape[1] else 1)


def test_muon_state_reshards_from_dp_2_to_tp_2(runs):
    """Guards against Muon's momentum (or the main weights) not following a resume into
    another tensor-parallel layout (started from zero, or read into the wrong slices):
    ``dp2``'s checkpoint at step 2, resumed at TP 2 with whole-matrix Newton-Schulz (as at TP
    1), ends step 4 with every parameter within :data:`TRACK` (RMS) of the run that never
    stopped."""
    ref = runs["dp2"][0]["params"]
    worst = max(_rms(_whole(runs["tp2resume"], n, ref[n]), ref[n]) for n in ref)
    assert worst < TRACK, worst


@pytest.mark.parametrize("adam", ["torch", "te"])
def test_adamw_step_counts_resume_bit_exact_where_the_optimizer_keeps_them(adam, cache_dir, tmp_path):
    """Guards against AdamW's step count going wrong across a resume of the layer-wise
    optimizer under Transformer Engine: TE's FusedAdam (megatron-core's Adam when TE is
    installed) keeps it in each param group, not per parameter, and does not advance it on a
    rank owning nothing of the group. A checkpoint that read per-parameter steps saved 0 and
    took the groups from rank 0 alone, so a rank owning a group rank 0 owns nothing of
    restarted it at step 1 (bias correction 2.2 instead of 1.0), and the load put a
    per-parameter step into TE's state, which its state_dict() refuses (KeyError: a
    --ckpt-format torch save failed). On 2 ranks, rank 0 owning none of an AdamW group, with
    torch's AdamW and with tests/te_fused_adam.py's stand-in for TE's: the checkpoint at
    step 2 holds every AdamW group's count (2); resumed there, the run ends step 4 with
    every parameter bit for bit the uninterrupted run's and each group a rank owns at the
    same count, and its --ckpt-format torch save at step 4 is written."""
    from loco_megatron.checkpoint.torch_dist import saved_common

    torchrun(2, [str(tmp_path), adam, *MUON], cache_dir, tmp_path, script="tests/muon_resume_run.py", name=adam)
    ref, resumed = _dump(tmp_path, "ref", 2), _dump(tmp_path, "resume", 2)
    owned = [[n for n, _ in ref[rank]["groups"][1]] for rank in range(2)]  # (AdamW's groups)
    assert any(mine == 0 and theirs > 0 for mine, theirs in zip(*owned)), owned
    assert saved_common(tmp_path / "ck" / "iter_0000002")["optimizer"][1]["common"]["steps"] == [2.0, 2.0]
    for a, b in zip(ref, resumed):
        assert [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])] == []
        counts = [[(step, other) for (n, step), (_, other) in zip(x, y) if n]
                  for x, y in zip(a["groups"], b["groups"])]
        assert all(step is not None and step == other for groups in counts[1:] for step, other in groups), counts
    assert sorted(p.name for p in (tmp_path / "ck2" / "iter_0000004").glob("rank_*.pt")) == \
        ["rank_00000.pt", "rank_00001.pt"]
