"""pretrain_gpt.py with the combination matrix's per-step checks (tests/test_matrix.py).

* ``IDENTICAL rank=R iter=I dense=B expert=B tp=B outer=B|-``: the model parameters of
  every data-parallel group (expert parameters: every expert-data-parallel group; under
  DiLoCo the replica's own groups, megatron's partial data-parallel groups) are
  bit-identical across its ranks after step ``I``. Checked just before each optimizer
  step (the forward pass has finished every parameter all-gather, --overlap-param-gather's
  deferred ones included, and nothing has changed them since) and once more after the
  last step, with the deferred gather finished the way a save finishes it. ``outer``
  (DiLoCo, after an outer step of every fragment with --diloco-sync-delay 0; ``-``
  elsewhere): every replica holds the same parameters, bit for bit, across the outer
  group (megatron's inter-instance group): the fp32 main parameters and the model's;
  with --param-gather-bits the main parameters only, as each replica's model weights
  are its own quantised gather of them.
* ``WIRE rank=R iter=I ...``: what this rank's step put on the wire, recorded at the
  collectives themselves (LoCo's injectable ops, megatron-core's bucket reduce-scatter
  and all-gather, the --param-gather-bits all-gather), next to the step's ``comm/``
  figures from ``CommStats.take``. ``grad_in``: bytes handed to gradient collectives of
  more than one rank; ``grad_out``: the part of them addressed to other ranks;
  ``param``: gathered parameter buffers of more than one rank (--optimizer muon: DDP's
  all-reduce of whole buckets and the layer-wise optimizer's all-gather, see
  :func:`_record_whole`).
"""

import json
import os
import pathlib
import sys
import warnings

import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.error_report import report_error
from loco_megatron.config import ConfigError
from loco_megatron.diloco.schedule import FragmentSchedule
from loco_megatron.loco.collectives import CollectiveOps
from loco_megatron.loco.hooks import GradSyncHook, ParamGatherHook
from loco_megatron.loco.hooks.diloco import main_shards
from loco_megatron.training import trainer
from param_identity import identical_across  # tests/ is this script's folder


def _say(line: str) -> None:
    sys.stdout.flush()
    os.write(1, (line + "\n").encode())  # one write() per line: ranks never interleave mid-line


def _nbytes(t) -> int:
    tensors = t if isinstance(t, (list, tuple)) else [t]
    return sum(x.numel() * x.element_size() for x in tensors)


class Wire:
    """Bytes of one step, counted at the collectives."""

    def __init__(self):
        self.grad_in = self.grad_out = self.param = 0
        self.checking = False
        """True while this script's own checks gather parameters (not the run's traffic)."""

    def grad(self, nbytes: int, group) -> None:
        world = dist.get_world_size(group)
        if world > 1:
            self.grad_in += nbytes
            self.grad_out += nbytes * (world - 1) // world

    def gathered(self, nbytes: int, group) -> None:
        if dist.get_world_size(group) > 1:
            self.param += nbytes

    def take(self) -> tuple:
        out = (self.grad_in, self.grad_out, self.param)
        self.grad_in = self.grad_out = self.param = 0
        return out


def _install_recorders(wire: Wire) -> tuple:
    """megatron-core's collectives wrapped in place (this process only); returns LoCo's
    gradient ops and the --param-gather-bits ops, recorded."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    rs, ag = pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func

    def reduce_scatter(out, inp, *args, group=None, **kwargs):
        wire.grad(_nbytes(inp), group)
        return rs(out, inp, *args, group=group, **kwargs)

    def all_gather_params(out, inp, *args, group=None, **kwargs):
        wire.gathered(_nbytes(out), group)
        return ag(out, inp, *args, group=group, **kwargs)

    pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func = reduce_scatter, all_gather_params

    def grad_op(fn, counted):
        def op(out, inp, group=None, async_op=False):
            wire.grad(_nbytes(counted(out, inp)), group)
            return fn(out, inp, group=group, async_op=async_op)
        return op

    def gather_params(out, inp, group=None, async_op=False):  # --param-gather-bits' all-gather
        wire.gathered(_nbytes(out), group)
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)

    grad_ops = CollectiveOps(all_to_all_single=grad_op(dist.all_to_all_single, lambda o, i: i),
                             all_gather=grad_op(dist.all_gather, lambda o, i: i),
                             all_gather_into_tensor=grad_op(dist.all_gather_into_tensor, lambda o, i: i),
                             all_reduce=dist.all_reduce)  # the TP replica average: not data-parallel bytes
    return grad_ops, CollectiveOps(all_gather_into_tensor=gather_params)


def _record_whole(wire: Wire, chunks: list) -> None:
    """Without megatron's distributed optimizer (--optimizer muon): DDP's all-reduce of each
    gradient bucket and the layer-wise optimizer's all-gather of whole parameters, recorded
    where megatron-core calls them (``torch.distributed``'s functions, patched here inside the
    run's platform context, which restores its own at the end of the run)."""
    grads = {id(b.grad_data) for c in chunks for g in list(c.bucket_groups) + list(c.expert_parallel_bucket_groups)
             for b in g.buckets}
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def all_reduce_recorded(tensor, *args, group=None, **kwargs):
        if id(tensor) in grads:
            wire.grad(_nbytes(tensor), group)
        return all_reduce(tensor, *args, group=group, **kwargs)

    def all_gather_recorded(tensor_list, tensor, group=None, async_op=False):
        if not wire.checking:
            wire.gathered(_nbytes(tensor_list), group)
        return all_gather(tensor_list, tensor, group=group, async_op=async_op)

    dist.all_reduce, dist.all_gather = all_reduce_recorded, all_gather_recorded


def _exact_main(optimizer, param_hook: ParamGatherHook) -> list:
    """The fp32 main parameters of this rank, exact: the distributed optimizer's main
    shards, except where --param-gather-bits gathers an fp32 model's buckets: there the
    model buffer (which is the optimizer's main) holds the gathered, quantised shard
    between steps and the exact one waits in the hook's spare shard (main_aliased, see
    loco_megatron/loco/param_delta.py: AgreedShard)."""
    aliased = [s for s in param_hook.shards.values() if s.main_aliased]
    spans = [(s.own.data_ptr(), s.own.data_ptr() + s.own.numel() * s.own.element_size()) for s in aliased]
    views = [v for pairs in main_shards(optimizer) for _, _, _, v in pairs
             if not any(a <= v.data_ptr() < b for a, b in spans)]
    return views + [s.spare for s in aliased]


def main() -> int:
    """``MATRIX_RUNS``: JSON ``[[tag, extra args], ...]``, runs one after another in these
    processes (each after the common ``argv``); ``MATRIX_RESUME_AT``: the iteration a run
    with ``--load`` resumes from."""
    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    wire = Wire()
    ops = _install_recorders(wire)  # (gradient ops, parameter-gather ops)
    # Later runs reuse the processes (each start-up saved is most of a tiny run's cost on
    # CPU) and the default process group (a second rendezvous on torchrun's store can meet
    # the first one's stale keys); megatron's parallel state is torn down between runs.
    trainer.shutdown_distributed = ps.destroy_model_parallel
    try:
        for tag, extra in json.loads(os.environ["MATRIX_RUNS"]):
            if int(os.environ.get("RANK", "0")) == 0:
                _say(f"=== run {tag} ===")
            code = run(sys.argv[1:] + extra, tag, wire, ops)
            if code:
                return code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _resume_at(load: str) -> None:
    """Point ``load``'s latest file at MATRIX_RESUME_AT. Every rank writes the same bytes
    and renames them into place before reading it: no rank can read another value."""
    at = os.environ.get("MATRIX_RESUME_AT")
    if at:
        latest = pathlib.Path(load) / "latest_checkpointed_iteration.txt"
        tmp = latest.with_name(f"{latest.name}.rank{os.environ.get('RANK', '0')}")
        tmp.write_text(f"{at}\n")
        os.replace(tmp, latest)


def run(argv: list, tag: str, wire: Wire, ops: tuple) -> int:
    config, env = main_config(argv)
    if config.checkpoint.load:
        _resume_at(config.checkpoint.load)
    wire.take()  # nothing of an earlier run (its final save's gather) counts here
    hooks: dict = {}  # the grad hook (its iteration) and the model chunks, once built

    d = config.diloco

    def check(iteration: int) -> None:
        wire.checking = True
        try:
            identical(iteration)
        finally:
            wire.checking = False

    def identical(iteration: int) -> None:
        from megatron.core import parallel_state as ps

        params = [p for c in hooks["chunks"] for p in c.parameters()]
        # Megatron's partial (intra-instance) groups exist only when DP splits into instances:
        # one replica (lookahead) keeps the plain groups and has no inter-instance group.
        replica = d.diloco_replicas > 1
        dp = (ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True) if replica
              else ps.get_data_parallel_group())
        dense = identical_across([p for p in params if getattr(p, "allreduce", True)], dp)
        expert = identical_across([p for p in params if not getattr(p, "allreduce", True)],
                                  ps.get_expert_data_parallel_group(partial_expert_data_parallel=replica))
        # Parameters TP does not split are replicated on every TP rank (tests/param_identity.py).
        tp = identical_across([p for p in params if not getattr(p, "tensor_model_parallel", False)],
                              ps.get_tensor_model_parallel_group())
        outer = "-"
        schedule = FragmentSchedule(d.diloco_inner_steps, d.diloco_fragments, d.diloco_sync_delay)
        # (eager updates: right after a sync the replicas differ by their eager parts)
        if (replica and not d.diloco_sync_delay and not d.diloco_eager
                and len(schedule.starts(iteration)) == d.diloco_fragments):
            group = ps.get_inter_distributed_optimizer_instance_group()
            outer = identical_across(_exact_main(hooks["optimizer"], hooks["param"]), group) and (
                bool(config.loco.param_gather_bits) or identical_across(params, group))
        _say(f"IDENTICAL run={tag} rank={dist.get_rank()} iter={iteration} dense={dense} expert={expert} tp={tp} "
             f"outer={outer}")

    def param_sync_factory(chunks, optimizer, loco, stats):
        hooks["chunks"], hooks["optimizer"] = chunks, optimizer
        if not config.megatron_distributed_optimizer:
            _record_whole(wire, chunks)
        step, take = optimizer.step, stats.take

        def checked_step():
            if hooks["grad"].iteration > 0:  # the parameters after the previous step
                check(hooks["grad"].iteration)
            return step()

        def recorded_take():
            comm, sums = take()
            it = hooks["grad"].iteration + 1
            grad_in, grad_out, param = wire.take()
            if it == hooks.get("taken"):
                # DiLoCo's final outer step after the last step takes the stats once more
                # (its outer bytes): no step of its own, nothing of the grad/param wire.
                return comm, sums
            hooks["taken"] = it
            _say(f"WIRE run={tag} rank={dist.get_rank()} iter={it} grad_in={grad_in} grad_out={grad_out} param={param} "
                 f"grad_metric={int(comm['comm/grad_bytes_sent'])} "
                 f"grad_split={int(comm['comm/grad_bytes_sent_intra'] + comm['comm/grad_bytes_sent_inter'])} "
                 f"param_metric={int(comm['comm/param_bytes_sent'])}")
            if it == config.train.train_iters:
                # What a save does first: finish a deferred gather (only the distributed
                # optimizer gathers parameters; without it megatron asserts on the call).
                for chunk in chunks if config.megatron_distributed_optimizer else ():
                    chunk.start_param_sync(force_sync=True)
                check(it)
            return comm, sums

        optimizer.step, stats.take = checked_step, recorded_take
        hooks["param"] = ParamGatherHook(chunks, optimizer, loco, stats, ops=ops[1])
        return hooks["param"]

    def grad_sync_factory(chunks, loco, stats):
        hooks["grad"] = GradSyncHook(chunks, loco, stats, ops=ops[0])
        return hooks["grad"]

    try:  # as pretrain_gpt.py: a refused resume is one line and exit status 2
        trainer.train(config, env, grad_sync_factory=grad_sync_factory, param_sync_factory=param_sync_factory)
    except ConfigError as e:
        report_error(e, env.rank)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
