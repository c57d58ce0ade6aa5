"""The one module that touches megatron-core's private internals.

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
get their own compressors, exactly like dense ones.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from loco_megatron.config import LoCoConfig
from loco_megatron.loco.collectives import ShardLayout, compressed_reduce_scatter
from loco_megatron.loco.compressor import LoCoCompressor
from loco_megatron.metrics.comm import CommStats

SUPPORTED_MCORE = ((0, 16, 0), (0, 17, 0))
"""megatron-core versions [low, high) whose bucket-group internals this hook matches."""


class UnsupportedMegatronCore(RuntimeError):
    pass


def check_megatron_core_version(version: Optional[str] = None) -> None:
    """Fail loudly unless the installed megatron-core is in :data:`SUPPORTED_MCORE`."""
    if version is None:
        from megatron.core.package_info import __version__ as version
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    low, high = SUPPORTED_MCORE
    if not low <= parts < high:
        raise UnsupportedMegatronCore(
            f"loco-megatron's gradient-bucket hook supports megatron-core "
            f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}; found {version}")


def _bucket_groups(ddp_model) -> list:
    return list(ddp_model.bucket_groups) + list(ddp_model.expert_parallel_bucket_groups)


class _MultiWork:
    """What megatron waits on: every bucket's handle of one bucket group."""

    def __init__(self, works, on_done: Callable[[list], None]):
        self._works, self._on_done = works, on_done

    def wait(self):
        t0 = time.perf_counter()
        for w in self._works:
            w.wait()
        self._on_done(self._works, time.perf_counter() - t0)


class _TimedWork:
    """Wraps megatron's own coalesced handle to record when its wait returns."""

    def __init__(self, work, launch_t: float, on_done):
        self._work, self.launch_t, self._on_done = work, launch_t, on_done

    def wait(self):
        t0 = time.perf_counter()
        self._work.wait()
        self.done_t = time.perf_counter()
        self.decompress_s = 0.0
        self._on_done([self], self.done_t - t0)


class GradSyncHook:
    """LoCo (or timing only) in place of megatron-core's per-bucket gradient sync."""

    def __init__(self, ddp_models: list, loco: LoCoConfig, stats: CommStats):
        check_megatron_core_version()
        self.loco, self.stats = loco, stats
        self.iteration = 0
        """Optimizer step being computed; set by the trainer (drives --loco-warmup-iters)."""
        self.compressors: dict[str, LoCoCompressor] = {}
        self._layouts: dict[str, ShardLayout] = {}
        for m, model in enumerate(ddp_models):
            ddp_config = model.ddp_config
            if loco.enabled and ddp_config.num_distributed_optimizer_instances > 1:
                raise ValueError("LoCo does not support --num-distributed-optimizer-instances > 1")
            for g, group in enumerate(_bucket_groups(model)):
                kind = "expert" if group in model.expert_parallel_bucket_groups else "dense"
                keys = [f"{kind}.chunk{m}.group{g}.bucket{b}" for b in range(len(group.buckets))]
                if loco.enabled:
                    self._make_compressors(group, keys)
                group.start_grad_sync = self._make_start_grad_sync(group, keys)

    def _make_compressors(self, group, keys) -> None:
        comm = self._comm_group(group)
        world = comm.size()
        for key, bucket in zip(keys, group.buckets):
            layout = ShardLayout(bucket.grad_data.numel(), world, self.loco.loco_bits,
                                 self.loco.loco_block_size)
            self._layouts[key] = layout
            self.compressors[key] = LoCoCompressor(
                layout.compressed_numel, bits=self.loco.loco_bits, beta=self.loco.loco_beta,
                block_size=self.loco.loco_block_size, error_bits=self.loco.loco_error_bits,
                reset_interval=self.loco.loco_reset_interval,
                error_feedback=not self.loco.loco_no_error_feedback,
                device=bucket.grad_data.device)

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
            if not self._compressing() or force_all_reduce:
                return self._timed_original(group, original, force_all_reduce)
            return self._loco_start(group, keys)

        return start_grad_sync

    def _record(self, works, wait_s: float, compressed: bool, sent: int, raw: int) -> None:
        self.stats.add_sync(
            total_s=sum(w.done_t - w.launch_t for w in works), exposed_s=wait_s,
            decompress_s=sum(w.decompress_s for w in works),
            bytes_sent=sent, bytes_uncompressed=raw, compressed=compressed)

    def _timed_original(self, group, original, force_all_reduce):
        raw = sum(b.grad_data.numel() * b.grad_data.element_size() for b in group.buckets)
        launch_t = time.perf_counter()
        original(force_all_reduce=force_all_reduce)
        if group.grad_reduce_handle is None:  # synchronous: already complete
            done = time.perf_counter()
            self.stats.add_sync(total_s=done - launch_t, exposed_s=done - launch_t, decompress_s=0.0,
                                bytes_sent=raw, bytes_uncompressed=raw, compressed=False)
            return
        group.grad_reduce_handle = _TimedWork(
            group.grad_reduce_handle, launch_t,
            lambda works, wait_s: self._record(works, wait_s, False, raw, raw))

    def _loco_start(self, group, keys):
        assert group.grad_reduce_handle is None, "one grad sync at a time per bucket group"
        ddp_config = group.ddp_config
        comm = self._comm_group(group)
        async_op = ddp_config.overlap_grad_reduce
        works, sent, raw = [], 0, 0
        for key, bucket in zip(keys, group.buckets):
            # Same scaling megatron applies before its reduce-scatter (1/DP for an average).
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            compressor = self.compressors[key]
            t0 = time.perf_counter()
            work, nbytes = compressed_reduce_scatter(
                bucket.grad_data, compressor.compress, self._layouts[key], comm, async_op=async_op,
                all_gather=not ddp_config.use_distributed_optimizer,
                average=ddp_config.average_in_collective)
            self.stats.add_compress(work.launch_t - t0)
            works.append(work)
            sent += nbytes
            raw += bucket.grad_data.numel() * bucket.grad_data.element_size()

        def done(ws, wait_s):
            self._record(ws, wait_s, True, sent, raw)

        multi = _MultiWork(works, done)
        if async_op:
            group.grad_reduce_handle = multi
        else:
            multi.wait()
            group.grad_reduce_handle = None

    # -- checkpointing: the error buffers and step counters --------------------------
    def state_dict(self) -> dict:
        return {key: c.state_dict() for key, c in self.compressors.items()}

    def load_state_dict(self, sd: dict) -> None:
        if set(sd) != set(self.compressors):
            raise ValueError("LoCo state in the checkpoint does not match this run's buckets "
                             f"({len(sd)} saved, {len(self.compressors)} here)")
        for key, c in self.compressors.items():
            c.load_state_dict(sd[key])
