"""pretrain_gpt.py with DiLoCo's replica checks (tests/test_diloco.py), one line per check.

After every step (after the outer step where the schedule puts one), each rank compares
across its *outer group* (the ranks holding the same shard in the other replicas):

* ``OUTER rank=R iter=I key=K identical=B``: the fp32 main parameters of every channel
  (one sub-optimizer's shard of one fragment) whose outer step was applied at ``I``;
* ``MODEL rank=R iter=I identical=B``: the whole model's parameters (the weights the
  forward pass uses) - equal right after an outer step of every fragment (tau 0, alpha 0),
  different in between, since each replica trains on its own data;
* ``INNER rank=R iter=I identical=B``: the model's parameters across the replica's own
  data-parallel ranks (megatron's intra-instance group): always equal;
* ``TIED rank=R iter=I identical=B`` (pipeline parallelism with tied embeddings): the first
  stage's word embedding and the last stage's output layer, its copy: always equal;
* ``AGREED rank=R iter=I key=K identical=B own=B`` (--diloco-eager, after each sync of
  K's fragment): the agreed parameters across the outer group, and whether the fp32 main
  parameters are this replica's own outer parameters (what it trains on from there).
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.diloco.setup import build_outer_step
from loco_megatron.training.trainer import train
from param_identity import identical_across  # tests/ is this script's folder


def _say(line: str) -> None:
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())


def checked_outer_step(config, chunks, optimizer, stats, log):
    from megatron.core import parallel_state as ps

    outer = build_outer_step(config, chunks, optimizer, stats, log)
    after_step = outer.after_step
    group = next(iter(outer.channels.values()))[1].group
    inner = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    rank = dist.get_rank()
    tied = None  # this stage's copy of a tied embedding split over pipeline stages
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        tied = next((p for c in chunks for p in c.parameters() if getattr(p, "shared_embedding", False)), None)

    def checked(t: int) -> None:
        after_step(t)
        applied = outer.schedule.applies(t)
        eager = getattr(outer, "eager", None)
        for key, (views, _, _, f) in outer.channels.items():
            if eager is not None and f in outer.schedule.starts(t):
                same = identical_across([outer.agreed[key]], group)
                own = all(torch.equal(v, part) for v, part in views._pairs(eager[key].own(outer.agreed[key])))
                _say(f"AGREED rank={rank} iter={t} key={key} identical={same} own={own}")
            elif f in applied:
                same = identical_across([torch.cat(views.views)], group)
                _say(f"OUTER rank={rank} iter={t} key={key} identical={same}")
        params = [p for c in chunks for p in c.parameters()]
        _say(f"MODEL rank={rank} iter={t} identical={identical_across(params, group)}")
        _say(f"INNER rank={rank} iter={t} identical={identical_across(params, inner)}")
        if tied is not None:
            _say(f"TIED rank={rank} iter={t} identical={identical_across([tied], ps.get_embedding_group())}")

    outer.after_step = checked
    return outer


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    train(config, env, outer_step_factory=checked_outer_step)
