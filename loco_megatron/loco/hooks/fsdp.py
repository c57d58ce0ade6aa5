"""The gradient hook under Megatron-FSDP: LoCo on HSDP's cross-node replica reduction.

Megatron-FSDP (``FullyShardedDataParallel`` over ``MegatronFSDP``) reduces gradients per
bucket group in ``GradReducePipeline._bucket_group_gradient_reduce``: a reduce-scatter
over the sharding group (every micro-batch, with gradient sharding) and, with HSDP
(``--num-distributed-optimizer-instances`` > 1) on the last micro-batch of a step, an
all-reduce of each bucket's reduced shard over the outer group - the ranks holding the
same shard on the other nodes. The shard is this rank's ``N/R`` elements of the bucket
(``main_grad_buffer.get_shard_from_local_buffer()``): the whole ``main_grad_buffer.data``
when the buffer is sharded (``optim_grads``, ``optim_grads_params``), a slice of it when
it is not (``optim``, or any strategy over a sharding group of one rank: the buffer then
holds the whole bucket, where megatron accumulates the step's unreduced gradient).

:class:`FsdpGradHook` replaces that method *on the pipeline instance* (never on the class):

* sharded buffer, LoCo off (or warm-up): megatron's own method runs unchanged
  (bit-identical) and is timed and counted;
* unsharded buffer: megatron-core 0.16.1 adds the reduced shard onto the unreduced one it
  was computed from (the shard is a slice of the reduce-scatter's own input), and with a
  reduction every micro-batch (a sharding group of one rank) it rescales the accumulating
  bucket each time; megatron's method runs once per step, on the last micro-batch, with
  its reduced shard written to a separate zeroed tensor that then replaces the shard, and
  the outer reduction, of the shard only, is this hook's (uncompressed: an all-reduce of
  the shard, never of the whole bucket);
* LoCo on, on the step's outer reduction: megatron's method runs with the outer reduction
  turned off (the intra-node reduce-scatter at full precision, megatron's own), then
  each bucket's shard is compensated with its own error buffer (the shard's size:
  ``N/R`` elements, never the whole model) and quantised whole; the packed codes and
  scales of every replica are all-gathered over the outer group (one
  ``all_gather_into_tensor``) and every replica dequantises and sums the ``n`` rows in
  fp32 in rank order (:func:`~..collectives.compressed_all_gather_sum`), so every replica
  ends with the same shard and only low-bit codes cross nodes ((n-1) packed shards per
  rank). Once per optimizer step, synchronously, in the
  program order of megatron's backward hooks (the same on every rank), through an
  injectable :class:`~..collectives.CollectiveOps`.

An outer group of one rank (a single node) sends nothing: megatron's path, 0 bytes.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.config import LoCoConfig
from loco_megatron.loco.collectives import (TORCH_OPS, CollectiveOps, ShardLayout, compressed_all_gather_sum,
                                            gathered_layout)
from loco_megatron.loco.compressor import LoCoCompressor, load_compressor_states
from loco_megatron.loco.hooks.version import check_megatron_core_version
from loco_megatron.loco.kernel_choice import hook_kernels
from loco_megatron.loco.quantize import QuantOptions
from loco_megatron.loco.workspace import Workspace
from loco_megatron.metrics.comm import CommStats


def node_split(ranks: list, ranks_per_node: int, nbytes: int) -> tuple[int, int]:
    """Of ``nbytes`` handed to a collective over ``ranks`` (an equal part per rank, as in
    a reduce-scatter or all-to-all), the bytes addressed to other ranks of this node and
    to ranks on other nodes."""
    me, world = dist.get_rank(), len(ranks)
    local = sum(1 for r in ranks if r // ranks_per_node == me // ranks_per_node)
    return nbytes * (local - 1) // world, nbytes * (world - local) // world


class FsdpGradHook:
    """LoCo (or timing only) in place of Megatron-FSDP's bucket-group gradient reduction.
    ``chunks``: the one ``FullyShardedDataParallel`` model; checkpointable (the error
    buffers and step counters)."""

    def __init__(self, chunks: list, loco: LoCoConfig, stats: CommStats, ops: CollectiveOps = TORCH_OPS,
                 log: Optional[Callable[[str], None]] = None):
        check_megatron_core_version()
        assert len(chunks) == 1, "Megatron-FSDP runs one model chunk (no virtual pipeline stages)"
        self.loco, self.stats, self.clock, self.ops = loco, stats, stats.clock, ops
        self.load_notes: list[str] = []
        """What loading a checkpoint reset or took over on this rank (one line each); the
        checkpoint loader gathers every rank's and prints each once, naming the ranks
        (:mod:`loco_megatron.checkpoint.load_notes`): this rank alone may not fit."""
        self._log = log or self.load_notes.append
        self.iteration = 0
        """Optimizer step being computed; set by the trainer (drives --loco-warmup-iters)."""
        fsdp = chunks[0].module  # MegatronFSDP
        self._fsdp = fsdp
        self._pipeline = fsdp.grad_reduce_pipeline
        self._buffer = self._pipeline.buffer
        self._ddp_config = fsdp.ddp_config
        index = self._buffer.dist_index
        self._outer = index.get_outer_fsdp_group() if index.use_hybrid_fsdp else None
        self._rpn = loco.loco_ranks_per_node or dist.get_world_size()
        self._kernels, self._decompress = hook_kernels(loco.loco_kernels)
        self._options = QuantOptions(**loco.options_for(loco.loco_bits), seed=loco.loco_quant_seed)
        self._workspace = Workspace()
        self.compressors: dict[str, LoCoCompressor] = {}
        self._layouts: dict[str, ShardLayout] = {}
        self._padding: dict[int, list[tuple[int, int]]] = {}  # bucket -> shard ranges holding no parameter
        gbufs = [g.main_grad_buffer for g in self._buffer.parameter_groups if g.main_grad_buffer is not None]
        # One sharding group for every bucket (no expert parameters), so all or none are sharded.
        assert len({g.is_data_distributed for g in gbufs}) <= 1
        self._unsharded = bool(gbufs) and not gbufs[0].is_data_distributed
        """The gradient buffers hold whole buckets (see the module doc)."""
        if loco.enabled and self._outer is not None and self._outer.size() > 1:
            for i, group in enumerate(self._buffer.parameter_groups):
                if group.main_grad_buffer is not None:
                    self._make_compressor(f"fsdp.bucket{i}", self._shard(i))
                    self._padding[i] = _padding_ranges(group.main_grad_buffer)
        self._original = self._pipeline._bucket_group_gradient_reduce  # the bound megatron method
        self._pipeline._bucket_group_gradient_reduce = self._reduce
        self._pending: list[int] = []  # buckets whose cross-node reduction LoCo owes this step
        self._original_sync = fsdp.synchronize_gradient_reduce
        fsdp.synchronize_gradient_reduce = self._synchronize_gradient_reduce

    def _make_compressor(self, key: str, shard: torch.Tensor) -> None:
        lc = self.loco
        # One row per replica, each its whole shard: the compressor quantises the shard as
        # one flat row (rows = 1), padded to whole blocks exactly as the gathered layout's rows.
        self._layouts[key] = gathered_layout(shard.numel(), self._outer.size(), lc.loco_bits, lc.loco_block_size,
                                             options=self._options)
        layout = ShardLayout(shard.numel(), 1, lc.loco_bits, lc.loco_block_size, options=self._options)
        stream = zlib.crc32(f"{key}/rank{dist.get_rank()}".encode())  # stochastic rounding stream
        self.compressors[key] = LoCoCompressor(
            **layout.compressor_shape(), bits=lc.loco_bits, beta=lc.loco_beta, block_size=lc.loco_block_size,
            error_bits=lc.loco_error_bits, reset_interval=lc.loco_reset_interval,
            error_feedback=lc.loco_error_feedback, device=shard.device, kernels=self._kernels,
            options=self._options, stream=stream)

    def _compressing(self) -> bool:
        return bool(self.compressors) and self.iteration >= self.loco.loco_warmup_iters

    def _gbuf(self, bucket_id: int):
        return self._buffer.parameter_groups[bucket_id].main_grad_buffer

    def _shard(self, bucket_id: int) -> torch.Tensor:
        """This rank's reduced shard of the bucket: ``[N/R]``, the gradient buffer's dtype."""
        return self._gbuf(bucket_id).get_shard_from_local_buffer()

    def _on_reduce_stream(self):
        """Megatron's reduce-scatter stream (on GPU): what follows its reduction runs after it."""
        rs_stream = self._pipeline.rs_stream
        if rs_stream is not None and torch.cuda.is_available():
            return torch.cuda.stream(rs_stream)
        return contextlib.nullcontext()

    def _reduce(self, bucket_group: list, async_op: bool = False, outer_fsdp_group_grad_reduce: bool = False):
        compress = outer_fsdp_group_grad_reduce and self._compressing()
        start = self.clock.mark()
        if self._unsharded:
            out = self._reduce_unsharded(bucket_group, async_op, outer_fsdp_group_grad_reduce, compress)
        else:
            out = self._original(bucket_group, async_op=async_op,
                                 outer_fsdp_group_grad_reduce=outer_fsdp_group_grad_reduce and not compress)
            self._count_inner(bucket_group)
            if outer_fsdp_group_grad_reduce and not compress:
                self._count_outer_uncompressed(bucket_group)
        if compress:  # the compressed replica reduction runs once backward is over
            self._pending.extend(bucket_group)
        end = self.clock.mark()
        self.stats.add_interval("grad_sync_total", start, end)
        self.stats.add_interval("grad_sync_exposed", start, end)
        return out

    def _reduce_unsharded(self, bucket_group: list, async_op: bool, outer: bool, compress: bool):
        """Megatron's reduction of buckets whose gradient buffer holds the whole bucket (see
        the module doc): once per step, the reduced shard replacing the unreduced one."""
        if not (getattr(self._fsdp, "is_last_microbatch", False) or self._fsdp.model_auto_sync):
            # A sharding group of one rank reducing every micro-batch: the bucket keeps
            # accumulating in place; nothing is sent, the parameters are only marked done
            # (as megatron's bucket release does).
            for bucket_id in bucket_group:
                self._pipeline.bucket_grad_ready_params[bucket_id] = set()
            return True
        gbufs = [self._gbuf(b) for b in bucket_group]
        sinks = [torch.zeros_like(self._shard(b)) for b in bucket_group]
        for gbuf, sink in zip(gbufs, sinks):  # where megatron adds its reduced shard
            gbuf.get_shard_from_local_buffer = lambda sink=sink: sink
        try:
            out = self._original(bucket_group, async_op=async_op, outer_fsdp_group_grad_reduce=False)
        finally:
            for gbuf in gbufs:
                del gbuf.get_shard_from_local_buffer
        self._count_inner(bucket_group)
        plain_outer = outer and not compress and self._outer is not None and self._outer.size() > 1
        op = dist.ReduceOp.AVG if self._ddp_config.average_in_collective else dist.ReduceOp.SUM
        with self._on_reduce_stream():  # after megatron's reduce-scatter, in stream order
            for bucket_id, sink in zip(bucket_group, sinks):
                shard = self._shard(bucket_id)
                shard.copy_(sink)
                if sink.is_cuda:
                    sink.record_stream(torch.cuda.current_stream())
                if plain_outer:
                    self.ops.all_reduce(shard, op=op, group=self._outer)
        if plain_outer:
            self._count_outer_uncompressed(bucket_group)
        return out

    def _synchronize_gradient_reduce(self) -> None:
        """megatron's wait for every bucket's (intra-node) reduction, then LoCo's cross-node
        reduction of every bucket the step marked, in marking order (the same on every rank:
        megatron's backward hooks issue buckets in program order)."""
        self._original_sync()
        rs_stream = self._pipeline.rs_stream
        if rs_stream is not None and torch.cuda.is_available():
            # The shards are accumulated (and, unsharded, installed and reduced) there;
            # megatron's own wait covers its events, recorded before this hook's work.
            torch.cuda.current_stream().wait_stream(rs_stream)
        if not self._pending:
            return
        start = self.clock.mark()
        pending, self._pending = self._pending, []
        for bucket_id in pending:
            self._loco_outer(bucket_id)
        end = self.clock.mark()
        self.stats.add_interval("grad_sync_total", start, end)
        self.stats.add_interval("grad_sync_exposed", start, end)

    def _count_inner(self, bucket_group: list) -> None:
        """Megatron's reduce-scatter over the sharding group:
        every bucket handed at its dtype."""
        for bucket_id in bucket_group:
            gbuf = self._gbuf(bucket_id)
            group = gbuf.data_parallel_group
            if group.size() == 1:
                continue
            nbytes = gbuf.bucket_index.size * gbuf.data.element_size()
            self.stats.add_bytes(nbytes, nbytes, compressed=False)
            self.stats.add_hop_bytes(*node_split(dist.get_process_group_ranks(group), self._rpn, nbytes))

    def _count_outer_uncompressed(self, bucket_group: list) -> None:
        """The all-reduce of each bucket's shard over the outer group."""
        if self._outer.size() == 1:
            return
        ranks = dist.get_process_group_ranks(self._outer)
        for bucket_id in bucket_group:
            data = self._shard(bucket_id)
            nbytes = data.numel() * data.element_size()
            self.stats.add_bytes(nbytes, nbytes, compressed=False)
            self.stats.add_hop_bytes(*node_split(ranks, self._rpn, nbytes))

    def _loco_outer(self, bucket_id: int) -> None:
        key = f"fsdp.bucket{bucket_id}"
        shard = self._shard(bucket_id)
        # megatron's padding holds whatever its reduce-scatter left there (uninitialised
        # memory): zeroed, so it cannot enter a block's scale or the error buffer.
        for a, b in self._padding[bucket_id]:
            shard[a:b].zero_()
        compressor = self.compressors[key]
        marks, sent = compressed_all_gather_sum(
            shard, lambda flat: compressor.compress(flat, self._workspace), self._layouts[key], self._outer,
            average=self._ddp_config.average_in_collective, clock=self.clock, decompress=self._decompress,
            ops=self.ops)
        self.stats.add_interval("compress", marks[0], marks[1])
        self.stats.add_interval("decompress", marks[2], marks[3])
        self.stats.add_loco(compressor.last_stats)
        self.stats.add_bytes(sent, shard.numel() * shard.element_size(), compressed=True)
        # The all-gather delivers this rank's packed row to every other replica: node_split
        # of (world x row) attributes (local-1) rows within the node and (world-local) across.
        world = self._outer.size()
        self.stats.add_hop_bytes(*node_split(dist.get_process_group_ranks(self._outer), self._rpn,
                                             sent * world // (world - 1)))

    # -- memory ---------------------------------------------------------------------
    def memory_report(self) -> dict:
        """As :meth:`GradSyncHook.memory_report`: error buffers (``persistent``), the
        largest bucket's scratch plus its send row and the ``n`` gathered rows (``transient``:
        one bucket at a time, synchronously), and the gradient elements compressed (``params``)."""
        persistent = sum(c.error_nbytes() for c in self.compressors.values())
        scratch = max((c.workspace_nbytes() for c in self.compressors.values()), default=0)
        in_flight = max(((lay.world + 1) * lay.row_bytes for lay in self._layouts.values()), default=0)
        return {"persistent": persistent, "transient": scratch + in_flight,
                "params": sum(lay.piece for lay in self._layouts.values())}

    def instrument(self, wrap: Callable[[object, str, str], None]) -> None:
        """Named profiler ranges around LoCo's compression (see GradSyncHook.instrument)."""
        for compressor in self.compressors.values():
            wrap(compressor, "compress", "loco/compress")

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {key: c.state_dict() for key, c in self.compressors.items()}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """Restore the error buffers; when they do not fit this run, start them at zero
        with one line (as :meth:`GradSyncHook.load_state_dict`)."""
        load_compressor_states(self.compressors, sd, self._log)


def _padding_ranges(gbuf) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of this rank's shard of ``gbuf`` that belong to no parameter
    (offsets into the shard; megatron's item offsets are into ``gbuf.data``, which starts at
    the shard only when the buffer is sharded)."""
    base, size = gbuf.shard_bucket_index.local_data_index, gbuf.shard_bucket_index.size
    used = sorted(gbuf._get_item_local_shard_index(i) for i in gbuf.item_index_map)
    ranges, pos = [], 0
    for a, b in used:
        if a == b:
            continue
        a, b = a - base, b - base
        if a > pos:
            ranges.append((pos, a))
        pos = max(pos, b)
    if pos < size:
        ranges.append((pos, size))
    return ranges


def skip_empty_shard_grads(optimizer) -> None:
    """megatron-core 0.16.1 fix: under Megatron-FSDP a parameter whose shard on this rank is
    empty (a small one split over many ranks) gets ``grad = None``, and the distributed
    optimizer's found-inf check (on with our constant loss scale of 1) reads
    ``param.grad.data`` of every parameter; it skips those (they hold no element). Replaces
    the method on this optimizer instance (and its chained ones) only."""
    check_megatron_core_version()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer

        def collect(inner=inner):
            return [p.grad.data for group in inner.param_groups for p in group["params"] if p.grad is not None]

        opt._collect_main_grad_data_for_unscaling = collect


class NoParamSync:
    """Megatron-FSDP's parameter gather: its own, layer by layer; nothing to install or
    checkpoint (the parameter-sync slot of the trainer)."""

    def __init__(self, *unused):
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd) -> None:
        pass


def fsdp_factories(default_grad: bool, grad_factory, default_param: bool, param_factory, optimizer):
    """The trainer's (gradient, parameter) sync factories under Megatron-FSDP: the defaults
    become :class:`FsdpGradHook` and :class:`NoParamSync` (a test's own factories are kept);
    applies :func:`skip_empty_shard_grads` to ``optimizer``."""
    skip_empty_shard_grads(optimizer)
    return (FsdpGradHook if default_grad else grad_factory), (NoParamSync if default_param else param_factory)
