"""The gradient hook: LoCo inside megatron-core's DDP bucket groups.

megatron-core's DDP launches each gradient bucket group's collective from
``_ParamAndGradBucketGroup.start_grad_sync`` (called by the backward hook of the last
param of the group with ``--overlap-grad-reduce``, else from ``finish_grad_sync``),
after scaling ``bucket.grad_data`` by ``bucket.gradient_scaling_factor``, and waits on
``group.grad_reduce_handle`` in ``finish_grad_sync``. :class:`GradSyncHook` replaces
``start_grad_sync`` *on each bucket-group instance* (never on the class), so that:

* with LoCo off, megatron's own method runs unchanged (bit-identical results) and is
  only timed;
* with LoCo on, each bucket is compensated, quantised and sent with one all-to-all
  (:func:`compressed_reduce_scatter`), and the handle megatron later waits on
  finishes the fp32 sum into this rank's shard of ``grad_data`` - the shard the
  distributed optimizer reads.

Expert-parallel bucket groups (synchronised over the expert-data-parallel group)
get their own compressors, exactly like dense ones. A bucket group whose sync group is
a single rank (DP=1; EP = DP for experts) sends nothing: it keeps megatron's exact path
and counts 0 bytes. Collectives are issued in program order only (see
:mod:`.two_hop` for the two-hop schedule), through an injectable
:class:`~.collectives.CollectiveOps`. ``start_param_sync`` (the
distributed optimizer's parameter all-gather) is wrapped the same way, for timing only.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch.distributed as dist

from loco_megatron.config import LoCoConfig
from loco_megatron.loco.collectives import TORCH_OPS, CollectiveOps, ShardLayout, compressed_reduce_scatter
from loco_megatron.loco.compressor import LoCoCompressor, load_compressor_states
from loco_megatron.loco.kernel_choice import hook_kernels
from loco_megatron.loco.quantize import QuantOptions
from loco_megatron.loco.workspace import Workspace
from loco_megatron.loco.two_hop import (Hop2Sequencer, NodeGroups, TwoHopLayout, TwoHopWork, build_node_groups,
                                        two_hop_reduce_scatter)
from loco_megatron.loco.hooks.version import check_megatron_core_version
from loco_megatron.metrics.comm import CommStats


def _bucket_groups(ddp_model) -> list:
    return list(ddp_model.bucket_groups) + list(ddp_model.expert_parallel_bucket_groups)


class _MultiWork:
    """What megatron waits on: every bucket's handle of one bucket group."""

    def __init__(self, works, clock, on_done: Callable[[list, object, object], None]):
        self._works, self._clock, self._on_done = works, clock, on_done

    def wait(self):
        start = self._clock.mark()
        for w in self._works:
            w.wait()
        self._on_done(self._works, start, self._clock.mark())


class _TimedWork:
    """Wraps megatron's own coalesced handle to mark when its wait returns."""

    def __init__(self, work, clock, launch_mark, on_done):
        self._work, self._clock, self.launch_mark, self._on_done = work, clock, launch_mark, on_done
        self.decompress_marks = None

    def wait(self):
        start = self._clock.mark()
        self._work.wait()
        self.done_mark = self._clock.mark()
        self._on_done([self], start, self.done_mark)


class GradSyncHook:
    """LoCo (or timing only) in place of megatron-core's per-bucket gradient sync, plus
    timing of the distributed optimizer's parameter all-gather."""

    def __init__(self, ddp_models: list, loco: LoCoConfig, stats: CommStats, ops: CollectiveOps = TORCH_OPS,
                 log: Optional[Callable[[str], None]] = None):
        check_megatron_core_version()
        self.loco, self.stats, self.clock = loco, stats, stats.clock
        self.ops = ops
        """The collectives this hook issues (the TP replica average issues its own through them too)."""
        self.load_notes: list[str] = []
        """What loading a checkpoint reset or took over on this rank (one line each); the
        checkpoint loader gathers every rank's and prints each once, naming the ranks
        (:mod:`loco_megatron.checkpoint.load_notes`): this rank alone may not fit."""
        self._log = log or self.load_notes.append
        self.iteration = 0
        """Optimizer step being computed; set by the trainer (drives --loco-warmup-iters)."""
        self.compressors: dict[str, LoCoCompressor] = {}
        self._layouts: dict[str, ShardLayout] = {}
        self._workspace = Workspace()  # one scratch for all buckets (they compress in turn)
        self._kernels, self._decompress = hook_kernels(loco.loco_kernels)
        self._options = QuantOptions(**loco.options_for(loco.loco_bits), seed=loco.loco_quant_seed)
        self._node_groups = self._build_node_groups(ddp_models) if loco.enabled else {}
        self._split: dict[int, tuple[int, int]] = {}  # comm group -> (its ranks on my node, its size)
        self._hop2_order = Hop2Sequencer()  # hop 2s in launch order on every rank
        self._single: set[int] = set()  # ids of bucket groups whose sync group is one rank
        self._groups: list = []  # (bucket group, uses the distributed optimizer), for instrument()
        for m, model in enumerate(ddp_models):
            ddp_config = model.ddp_config
            if loco.enabled and ddp_config.num_distributed_optimizer_instances > 1:
                raise ValueError("LoCo does not support --num-distributed-optimizer-instances > 1")
            for g, group in enumerate(_bucket_groups(model)):
                kind = "expert" if group in model.expert_parallel_bucket_groups else "dense"
                keys = [f"{kind}.chunk{m}.group{g}.bucket{b}" for b in range(len(group.buckets))]
                if self._comm_group(group).size() == 1:
                    # DP=1, or an expert-data-parallel group of one rank (EP = DP): nothing
                    # leaves the rank, so megatron's own (exact) path runs and 0 bytes count.
                    self._single.add(id(group))
                elif loco.enabled:
                    self._make_compressors(group, keys)
                group.start_grad_sync = self._make_start_grad_sync(group, keys)
                self._groups.append((group, ddp_config.use_distributed_optimizer))
                if ddp_config.use_distributed_optimizer:
                    group.start_param_sync = self._make_start_param_sync(group)

    def _build_node_groups(self, ddp_models: list) -> dict:
        """comm group -> NodeGroups for two-hop LoCo (absent: flat). Collective."""
        if self.loco.loco_hierarchical is False or not self.loco.loco_ranks_per_node:
            return {}
        comm_groups = []
        for model in ddp_models:
            for group in _bucket_groups(model):
                c = self._comm_group(group)
                if all(c is not x for x in comm_groups):
                    comm_groups.append(c)
        built = build_node_groups(comm_groups, self.loco.loco_ranks_per_node)
        # Two hops need several nodes *and* several ranks per node; otherwise flat is the same.
        return {id(c): ng for c, ng in zip(comm_groups, built) if ng is not None and ng.per_node > 1}

    def _split_bytes(self, group, nbytes: int) -> None:
        """Flat collectives: the payload addressed to ranks of this node vs other nodes
        (rows of an all-to-all, shards of a reduce-scatter)."""
        rpn = self.loco.loco_ranks_per_node
        if not rpn:
            return
        comm = self._comm_group(group)
        if id(comm) not in self._split:
            ranks = dist.get_process_group_ranks(comm)
            node = dist.get_rank() // rpn
            self._split[id(comm)] = (sum(1 for r in ranks if r // rpn == node), len(ranks))
        local, world = self._split[id(comm)]
        self.stats.add_hop_bytes(nbytes * (local - 1) // world, nbytes * (world - local) // world)

    def _make_compressors(self, group, keys) -> None:
        comm = self._comm_group(group)
        world = comm.size()
        node_groups = self._node_groups.get(id(comm))
        if node_groups is not None:
            return self._make_two_hop_compressors(group, keys, node_groups)
        for key, bucket in zip(keys, group.buckets):
            # Without the distributed optimizer megatron does not pad buckets to a multiple
            # of DP: the layout's last row is then shorter (padded inside the compressor).
            layout = ShardLayout(bucket.grad_data.numel(), world, self.loco.loco_bits,
                                 self.loco.loco_block_size, options=self._options)
            self._layouts[key] = layout
            self.compressors[key] = self._compressor(layout, self.loco.loco_bits, bucket.grad_data.device, key)

    def _compressor(self, layout: ShardLayout, bits: int, device, key: str) -> LoCoCompressor:
        lc = self.loco
        # Stochastic rounding stream: this buffer on this rank (the seed and step do the rest).
        stream = zlib.crc32(f"{key}/rank{dist.get_rank()}".encode())
        return LoCoCompressor(**layout.compressor_shape(), bits=bits, beta=lc.loco_beta,
                              block_size=lc.loco_block_size, error_bits=lc.loco_error_bits,
                              reset_interval=lc.loco_reset_interval,
                              error_feedback=lc.loco_error_feedback, device=device, kernels=self._kernels,
                              options=self._options, stream=stream)

    def _make_two_hop_compressors(self, group, keys, ng: NodeGroups) -> None:
        for key, bucket in zip(keys, group.buckets):
            layout = TwoHopLayout(bucket.grad_data.numel(), ng.nodes, ng.per_node, self.loco.loco_intra_node_bits,
                                  self.loco.loco_bits, self.loco.loco_block_size, options=self._options)
            self._layouts[key] = layout
            dev = bucket.grad_data.device
            if layout.intra is not None:  # hop 1 compensates its own compression error
                self.compressors[key + ".intra"] = self._compressor(layout.intra, self.loco.loco_intra_node_bits, dev,
                                                                   key + ".intra")
            self.compressors[key + ".inter"] = self._compressor(layout.inter, self.loco.loco_bits, dev, key + ".inter")

    @staticmethod
    def _comm_group(group):
        if group.ddp_config.use_distributed_optimizer:
            return group.intra_distributed_optimizer_instance_group
        return group.data_parallel_group

    def _compressing(self) -> bool:
        return self.loco.enabled and self.iteration >= self.loco.loco_warmup_iters

    def _make_start_grad_sync(self, group, keys):
        original = group.start_grad_sync  # the bound megatron method

        def start_grad_sync(force_all_reduce: Optional[bool] = False):
            if group.is_first_batch and group.grad_reduce_handle is not None:
                return  # megatron's own rule: already dispatched in the first batch
            if id(group) in self._single:
                return self._timed_original(group, original, force_all_reduce, single_rank=True)
            if not self._compressing() or force_all_reduce:
                return self._timed_original(group, original, force_all_reduce)
            return self._loco_start(group, keys)

        return start_grad_sync

    def _make_start_param_sync(self, group):
        original = group.start_param_sync

        def start_param_sync(force_sync: bool = False):
            # Without --overlap-param-gather megatron's all-gather is synchronous, so
            # launch-to-return is the whole collective (and all of it is exposed).
            start = self.clock.mark()
            original(force_sync=force_sync)
            if group.param_gather_handle is None:
                self.stats.add_interval("param_gather", start, self.clock.mark())
            else:
                group.param_gather_handle = _TimedWork(
                    group.param_gather_handle, self.clock, start,
                    lambda works, s, e: self.stats.add_interval("param_gather", start, e))

        return start_param_sync

    def _record(self, works, wait_start, wait_end, compressed: bool, sent: int, raw: int) -> None:
        self.stats.add_interval("grad_sync_exposed", wait_start, wait_end)
        for w in works:
            self.stats.add_interval("grad_sync_total", w.launch_mark, w.done_mark)
            if w.decompress_marks is not None:
                self.stats.add_interval("decompress", *w.decompress_marks)
        self.stats.add_bytes(sent, raw, compressed)

    def _timed_original(self, group, original, force_all_reduce, single_rank: bool = False):
        raw = sum(b.grad_data.numel() * b.grad_data.element_size() for b in group.buckets)
        if single_rank:  # nothing is handed to another rank: 0 bytes, at any dtype
            raw = 0
        self._split_bytes(group, raw)
        launch = self.clock.mark()
        original(force_all_reduce=force_all_reduce)
        if group.grad_reduce_handle is None:  # synchronous: already complete, all exposed
            done = self.clock.mark()
            self.stats.add_interval("grad_sync_total", launch, done)
            self.stats.add_interval("grad_sync_exposed", launch, done)
            self.stats.add_bytes(raw, raw, compressed=False)
            return
        group.grad_reduce_handle = _TimedWork(
            group.grad_reduce_handle, self.clock, launch,
            lambda works, s, e: self._record(works, s, e, False, raw, raw))

    def _loco_start(self, group, keys):
        assert group.grad_reduce_handle is None, "one grad sync at a time per bucket group"
        ddp_config = group.ddp_config
        comm = self._comm_group(group)
        async_op = ddp_config.overlap_grad_reduce
        works, sent, raw = [], 0, 0
        # The fixed point where earlier buckets' hop 2s are issued (two_hop's docstring):
        # before this group's hop 1s, on every rank, whatever has completed by now.
        self._hop2_order.flush()
        for key, bucket in zip(keys, group.buckets):
            # Same scaling megatron applies before its reduce-scatter (1/DP for an average).
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            if isinstance(self._layouts[key], TwoHopLayout):
                work = self._two_hop_start(key, bucket, comm, ddp_config, async_op)
                works.append(work)
                raw += bucket.grad_data.numel() * bucket.grad_data.element_size()
                continue
            compressor = self.compressors[key]
            start = self.clock.mark()
            work, nbytes = compressed_reduce_scatter(
                bucket.grad_data, lambda flat: compressor.compress(flat, self._workspace),
                self._layouts[key], comm, async_op=async_op,
                all_gather=not ddp_config.use_distributed_optimizer,
                average=ddp_config.average_in_collective, clock=self.clock, decompress=self._decompress,
                ops=self.ops)
            self.stats.add_interval("compress", start, work.launch_mark)
            self.stats.add_loco(compressor.last_stats)
            self._split_bytes(group, nbytes)
            works.append(work)
            sent += nbytes
            raw += bucket.grad_data.numel() * bucket.grad_data.element_size()

        def done(ws, wait_start, wait_end):
            two_hop = [w for w in ws if isinstance(w, TwoHopWork)]
            for w in two_hop:
                for marks in w.extra_compress_marks:
                    self.stats.add_interval("compress", *marks)
                for marks in w.extra_decompress_marks:
                    self.stats.add_interval("decompress", *marks)
            self.stats.add_hop_bytes(sum(w.bytes_intra for w in two_hop), sum(w.bytes_inter for w in two_hop))
            # Every byte handed to a collective, the all-gather without the distributed
            # optimizer included (it moves the reduced shards at the gradient dtype); for
            # two-hop both hops' rows, own rows included, as for flat LoCo (the intra/inter
            # split above counts only what goes to other ranks).
            gathered = sum(w.gather_bytes for w in ws)
            # (the all-gather's rows go to every other rank of the group: split as a flat collective's)
            self._split_bytes(group, gathered)
            self._record(ws, wait_start, wait_end, True,
                         sent + gathered + sum(w.bytes_handed for w in two_hop), raw)

        multi = _MultiWork(works, self.clock, done)
        if async_op:
            group.grad_reduce_handle = multi
        else:
            multi.wait()
            group.grad_reduce_handle = None

    def _two_hop_start(self, key, bucket, comm, ddp_config, async_op) -> TwoHopWork:
        ng = self._node_groups[id(comm)]
        intra = self.compressors.get(key + ".intra")
        inter = self.compressors[key + ".inter"]

        def compress_inter(flat):
            out = inter.compress(flat, self._workspace)
            self.stats.add_loco(inter.last_stats)
            return out

        start = self.clock.mark()
        work, _ = two_hop_reduce_scatter(
            bucket.grad_data, self._layouts[key], ng,
            (lambda flat: intra.compress(flat, self._workspace)) if intra else None,
            compress_inter, async_op=async_op,
            average=ddp_config.average_in_collective, clock=self.clock, decompress=self._decompress,
            gather_group=None if ddp_config.use_distributed_optimizer else comm, sequencer=self._hop2_order,
            workspace=self._workspace, ops=self.ops)
        self.stats.add_interval("compress", start, work.launch_mark)
        if intra is not None:
            self.stats.add_loco(intra.last_stats)
        return work

    # -- profiling ------------------------------------------------------------------
    def instrument(self, wrap: Callable[[object, str, str], None]) -> None:
        """Let a profiler put named ranges around LoCo and megatron's sync phases:
        ``wrap(obj, method_name, range_name)`` replaces ``obj.method_name`` with a wrapper
        (kept here so that only this package reaches into megatron's bucket groups)."""
        for compressor in self.compressors.values():
            wrap(compressor, "compress", "loco/compress")
        wrap(self, "_decompress", "loco/decompress")
        for group, distopt in self._groups:
            wrap(group, "start_grad_sync", "grad_sync/launch")
            wrap(group, "finish_grad_sync", "grad_sync/wait")
            if distopt:
                wrap(group, "start_param_sync", "param_gather")

    # -- memory ---------------------------------------------------------------------
    def memory_report(self) -> dict:
        """LoCo's memory on this rank, in bytes: ``persistent`` (error buffers, kept across
        steps), ``transient`` (at most, during a step: the shared workspace's scratch and
        two-hop's hop-1 result for the largest bucket, plus the codes of every bucket in
        flight, sent and received), and ``params`` (gradient elements compressed)."""
        persistent = sum(c.error_nbytes() for c in self.compressors.values())
        scratch = max((c.workspace_nbytes() for c in self.compressors.values()), default=0)
        hop1 = max((4 * lay.hop1_numel for lay in self._layouts.values() if isinstance(lay, TwoHopLayout)),
                   default=0)
        in_flight = 0
        for lay in self._layouts.values():
            for part in ((lay.intra, lay.inter) if isinstance(lay, TwoHopLayout) else (lay,)):
                if part is not None:
                    in_flight += 2 * part.world * part.row_bytes  # send + receive buffers
        params = sum(lay.numel for lay in self._layouts.values())
        return {"persistent": persistent, "transient": scratch + hop1 + in_flight, "params": params}

    # -- checkpointing: the error buffers and step counters --------------------------
    def state_dict(self) -> dict:
        return {key: c.state_dict() for key, c in self.compressors.items()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore every compressor's error and step counter. When the checkpoint's LoCo
        state does not fit this run (another data-parallel layout, flat vs two-hop,
        --loco-bits/--loco-block-size/--loco-error-bits, error feedback on/off), the
        error buffers start from zero - what --loco-reset-interval does anyway - and one
        line says so: never a silent mismatch, never a crash. ``None``: the checkpoint
        was written under another layout (the loader said so): the buffers stay at zero."""
        load_compressor_states(self.compressors, sd, self._log)
