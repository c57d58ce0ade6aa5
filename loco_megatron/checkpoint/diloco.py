"""DiLoCo in torch_dist checkpoints (see :mod:`loco_megatron.diloco`): every replica's own
model and inner optimizer state, and the outer state in model space.

A checkpoint written with ``--diloco-replicas R`` holds

* replica 0's model and distributed-optimizer state under the keys a run without DiLoCo
  writes (``decoder.layers.0...``, ``optimizer.state.*``: what the Hugging Face export
  reads), replica ``r >= 1``'s under the same keys prefixed ``diloco.replica{r}.``.
  megatron-core numbers the data-parallel coordinate of a model replica id over the whole
  data-parallel group, so only replica 0 would write; here it is the rank's position
  inside its replica, so every replica writes exactly one copy of each shard;
* the agreed parameters and the outer momentum, the same on every replica, in model space:
  ``diloco.agreed.<model key>`` and ``diloco.momentum.<model key>``, fp32 of the model
  parameter's global shape, each rank's shard written in blocks as the optimizer's fp32
  main parameters are (:mod:`.dist_optimizer`), by replica 0 only; so they reshard over
  TP, PP, inner DP and the replica count. The schedule and the outer-step count are
  common state;
* in the checkpoint of a run's last step (``--train-iters`` or a stop), the model every
  replica ends on, after the final outer step
  (:meth:`~loco_megatron.diloco.outer.OuterStep.finish`): ``diloco.final.<model key>``,
  in the same form. The Hugging Face export and generation read it (else
  ``diloco.agreed``); a resume reads the rest, which is the state before that final
  step, so it continues exactly as a run that never stopped;
* per rank, under the layout tag (:data:`.torch_dist.PER_RANK`): the outer error buffers,
  the settled means of the exchanges in flight and, under --diloco-eager, the replica's
  eager part (its own outer parameters and momentum minus the agreed ones) and sent outer
  gradient
  (:class:`~loco_megatron.diloco.eager.EagerState`).

At load, replica ``r`` of a run with ``R'`` replicas reads saved replica ``r mod R`` (a
checkpoint written without DiLoCo counts as one replica, and so does a run without
DiLoCo); the agreed parameters and momentum reshard; under another layout the per-rank
part starts afresh and the one layout line says so (:func:`layout_note`). A checkpoint
without outer state gives every replica the saved model, and the outer step starts from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

NAME = "diloco"
"""The outer step's name among the checkpointed states."""


def replicas(layout: dict) -> int:
    """The replica count a layout key records (1 without DiLoCo)."""
    return int(layout.get("diloco_replicas") or 1)


def replica_of(layout_key: dict) -> int:
    """This rank's replica: replicas are contiguous blocks of ranks (:mod:`loco_megatron.diloco.layout`)."""
    return dist.get_rank() // (dist.get_world_size() // replicas(layout_key))


def assign_replica_keys(sd: dict, model_keys: list, layout_key: dict, saved_layout: Optional[dict]) -> None:
    """Point this rank's model entries ``model_keys`` and ``"optimizer"`` of ``sd`` (in place)
    at its replica's keys: saving (``saved_layout`` None), its own replica's; loading, saved
    replica ``r mod R`` (``diloco.replica{r}.`` prefixed for ``r >= 1``). Under DiLoCo the
    model's replica ids are renumbered inside the replica (:func:`_number_inside_replica`)
    where this replica is the one writing (or, loading, the first reading) those keys, so
    that every shard of every key has exactly one main replica, as megatron's access
    validation requires; other readers keep megatron's numbering (not main: ``r >= 1``)."""
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

    replica = replica_of(layout_key)
    saved = replicas(layout_key if saved_layout is None else saved_layout)
    if "diloco_replicas" in layout_key and replica < saved:
        _number_inside_replica({k: sd[k] for k in model_keys})
    if replica % saved:
        for name in (*model_keys, "optimizer"):
            if name in sd:
                add_prefix_for_sharding(sd[name], f"diloco.replica{replica % saved}.")


def _number_inside_replica(model_sd: dict) -> None:
    """Set the data-parallel coordinate of every model replica id to the rank's position
    inside its replica (in place): megatron-core's is the rank in the whole data-parallel
    group (expert parameters, keys ``...experts...``: the expert-data-parallel group).
    Replicas are contiguous blocks of those groups, so the position is the rank modulo
    the replica's size (megatron's partial data-parallel groups)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    groups = {False: (ps.get_data_parallel_rank(with_context_parallel=True),
                      ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True))}

    def relabel(sh):
        if isinstance(sh, ShardedBase) and isinstance(sh.replica_id, tuple):
            expert = ".experts." in sh.key
            if expert not in groups:
                groups[True] = (ps.get_expert_data_parallel_rank(),
                                ps.get_expert_data_parallel_world_size(partial_expert_data_parallel=True))
            rank, size = groups[expert]
            if sh.replica_id[-1] == rank:  # (anything else is not megatron's DP numbering: left alone)
                sh.replica_id = (*sh.replica_id[:-1], rank % size)
        return sh

    dict_list_map_inplace(relabel, model_sd)


def sharded_state_dict(outer, model_sd: dict, is_loading: bool, replica: int, momentum: bool,
                       per_rank=None) -> dict:
    """The outer step's torch_dist state: (saving) its common state, ``agreed``, (when
    ``momentum``) ``momentum`` and (saving, once set) ``final``: per channel, the blocks
    of this rank's shards in model space
    (a copy: an --async-save writer may read them while training goes on; loading: empty
    buffers), written by replica 0 (``replica``: this rank's); ``per_rank``: the
    ShardedObject of :meth:`~loco_megatron.diloco.outer.OuterStep.per_rank_state_dict`
    (None: not saved / not read)."""
    from loco_megatron.checkpoint.dist_optimizer import _pieces
    from loco_megatron.checkpoint.model_space import model_tensors

    meta = model_tensors(model_sd)
    out = {} if is_loading else outer.common_state()
    names = ["agreed", *(["momentum"] if momentum else []),
             # the run's last step: the model every replica ends on (exports read it; a resume does not)
             *(["final"] if not is_loading and outer.final is not None else [])]
    lanes = getattr(outer, "lane_blocks", None)
    for name in names:
        out[name] = {}
        for key, (views, *_rest) in outer.channels.items():
            flat = (torch.empty(views.numel, dtype=torch.float32) if is_loading
                    else getattr(outer, name)[key].clone())
            blocks = []
            if lanes is not None:  # elastic: the lanes hold canonical ranges, each element once per job
                from megatron.core.dist_checkpointing.mapping import ShardedTensor

                for mkey, global_shape, origin, shape, at in lanes(key):
                    blocks.append(ShardedTensor(f"diloco.{name}.{mkey}", flat[at:at + math.prod(shape)].view(shape),
                                                torch.float32, tuple(shape), tuple(global_shape), tuple(origin),
                                                axis_fragmentations=None, replica_id=0))
                if blocks or is_loading:
                    out[name][key] = blocks
                continue
            for (param, start, end), at in zip(views.slices, views.offsets):
                for m, shape, first in _pieces(meta[param], start, end, replica):
                    lo = at + first - start
                    blocks.append(dataclasses.replace(m, key=f"diloco.{name}.{m.key}",
                                                      data=flat[lo:lo + math.prod(shape)].view(shape)))
            out[name][key] = blocks
        if not out[name] and not is_loading:
            # (a rank that hosts no lane saves none of it: an empty list or dict would stay in
            # the common state once megatron takes the tensors out, where a host's goes, and
            # megatron would warn that the ranks' common states differ; loading, every rank
            # asks for every channel)
            del out[name]
    if per_rank is not None:
        out["per_rank"] = per_rank
    return out


def loaded_state(entry: Optional[dict]) -> Optional[dict]:
    """:meth:`~loco_megatron.diloco.outer.OuterStep.load_state_dict`'s dict from what
    :func:`sharded_state_dict`'s request loaded (blocks in flat order, per channel);
    None when the checkpoint holds no outer state."""
    if not entry or "agreed" not in entry:
        return None

    def flat(per_channel: dict) -> dict:  # (a rank hosting no lane has no blocks)
        return {key: torch.cat([b.reshape(-1) for b in blocks]) if blocks else torch.empty(0)
                for key, blocks in per_channel.items()}

    return {"schedule": entry["schedule"], "outer_steps": entry["outer_steps"], "agreed": flat(entry["agreed"]),
            "momentum": flat(entry["momentum"]) if "momentum" in entry else None,
            "per_rank": entry.get("per_rank"), "elastic": entry.get("elastic")}


def layout_note(layout_key: dict, saved_layout: dict, loaded: dict, outer) -> str:
    """The DiLoCo part of the one line a load under another layout prints ('' when neither
    the checkpoint nor this run has DiLoCo): whose model and optimizer each replica took,
    and what of the outer state starts afresh."""
    from loco_megatron.diloco.schedule import FragmentSchedule

    now, saved = replicas(layout_key), replicas(saved_layout)
    if "diloco_replicas" not in saved_layout:
        return ("; DiLoCo: the checkpoint has no outer state: every replica takes its model and optimizer, and the "
                "outer step starts from them (momentum at zero)") if outer is not None else ""
    if outer is None:
        return f"; DiLoCo: this run has no --diloco-replicas: it takes replica 0's model and optimizer (of {saved})"
    whose = (f"replica r takes saved replica r mod {saved}'s model and optimizer ({now} replicas, {saved} saved)"
             if now != saved else "each replica takes its own model and optimizer")
    common = loaded.get(NAME) or {}
    dropped = FragmentSchedule(*common["schedule"]).in_flight(int(loaded["iteration"])) if common else []
    errors = any(ch.comp1 is not None for _, ch, _, _ in outer.channels.values())
    momentum = " and outer momentum" if outer.mu and common.get("with_momentum") else ""
    return (f"; DiLoCo: {whose}, agreed parameters{momentum} resharded"
            + (", outer error buffers start at zero" if errors else "")
            + (", each replica's own eager outer state starts afresh" if getattr(outer, "eager", None) else "")
            + (f", the exchange(s) of fragment(s) {sorted({f for f, _ in dropped})} in flight dropped"
               if dropped else ""))
