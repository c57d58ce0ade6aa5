"""``--param-gather-bits``: the distributed optimizer's parameter all-gather, hooked.

megatron-core 0.16's ``_ParamAndGradBucketGroup.start_param_sync`` all-gathers each
bucket's ``param_data`` from the shards the distributed optimizer just wrote (called
from the optimizer step, or, with ``--overlap-param-gather``, from the forward
pre-hooks via ``finish_param_sync``, which then waits on ``param_gather_handle``).
:class:`ParamGatherHook` replaces ``start_param_sync`` *on each bucket-group instance*
(dense and expert groups alike), with the same contract:

* ``--param-gather-bits 0``: megatron's own method runs unchanged (bit-identical) and
  its bytes are counted;
* 8, 4 or 2: one :func:`~loco_megatron.loco.param_gather.compressed_param_all_gather` per
  bucket of quantised differences against the agreed parameters; the handle megatron
  waits on applies them, so every rank of the group holds bit-identical parameters.

It also wraps each (dense, expert) distributed optimizer's ``step_with_ready_grads``
(the update after megatron's found-inf check; skipped steps never reach it) to tell
the :class:`~loco_megatron.loco.param_delta.AgreedShard` of each of *its* buckets that
an update is coming (fp32 models: swap the exact main shard in first). Per optimizer
matters: the dense optimizer's synchronous gather runs over every bucket group of the
model, before the expert optimizer has stepped. A bucket group with no update since its
last gather (not stepped yet, a skipped step, a repeated forced sync) sends nothing:
every rank knows this from program order alone.

Install it *before* :class:`~loco_megatron.loco.hooks.grad_sync.GradSyncHook`, which then
times this method like megatron's own. Its all-gathers go through the
:class:`~loco_megatron.loco.collectives.CollectiveOps` it is given, like LoCo's.

Checkpoints: the spare shards are per-rank state. Whenever they cannot be used (another
layout, other buckets, written without --param-gather-bits, another parameter dtype)
:meth:`ParamGatherHook.load_state_dict` takes the loaded model as the agreed parameters
(one line): the spare shards were cloned from the *initial* weights at construction.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loco_megatron.config import LoCoConfig
from loco_megatron.loco.collectives import TORCH_OPS, CollectiveOps
from loco_megatron.loco.hooks.version import check_megatron_core_version
from loco_megatron.loco.kernel_choice import param_kernels
from loco_megatron.loco.param_delta import AgreedShard, DeltaLayout
from loco_megatron.loco.param_gather import compressed_param_all_gather
from loco_megatron.loco.quantize import QuantOptions
from loco_megatron.metrics.comm import CommStats


class NonFiniteParamUpdate(RuntimeError):
    pass


class _GroupWork:
    """What megatron waits on: every bucket's gather of one bucket group."""

    def __init__(self, works: list, stats: CommStats):
        self._works, self._stats = works, stats

    def wait(self) -> None:
        for w in self._works:
            w.wait()
            self._stats.add_interval("param_compress", *w.compress_marks)
            self._stats.add_interval("param_decompress", *w.decompress_marks)
            self._stats.add_param_error(w.stats)
        self._works = []


class ParamGatherHook:
    """Compressed (or counted) parameter all-gather for every bucket group of ``ddp_models``;
    wraps ``optimizer.step``. Checkpointable (the agreed/main spare shards). ``ops``: the
    collectives it issues; ``log``: gets each line a checkpoint load has to say (default: kept
    in ``load_notes``, which the loader announces once for all ranks)."""

    def __init__(self, ddp_models: list, optimizer, loco: LoCoConfig, stats: CommStats,
                 ops: CollectiveOps = TORCH_OPS, log: Optional[Callable[[str], None]] = None):
        check_megatron_core_version()
        self.bits, self.stats, self._ops = loco.param_gather_bits, stats, ops
        self.load_notes: list[str] = []
        """What loading a checkpoint reset or took over on this rank (one line each); the
        checkpoint loader gathers every rank's and prints each once, naming the ranks
        (:mod:`loco_megatron.checkpoint.load_notes`): this rank alone may not fit."""
        self._log = log or self.load_notes.append
        self.shards: dict[str, AgreedShard] = {}
        self._layouts: dict[str, DeltaLayout] = {}
        self._buckets: dict[str, object] = {}
        for m, model in enumerate(ddp_models):
            if not model.ddp_config.use_distributed_optimizer:
                if self.bits:
                    raise ValueError("--param-gather-bits needs --use-distributed-optimizer")
                continue
            groups = list(model.bucket_groups) + list(model.expert_parallel_bucket_groups)
            for g, group in enumerate(groups):
                kind = "expert" if group in model.expert_parallel_bucket_groups else "dense"
                keys = [f"{kind}.chunk{m}.group{g}.bucket{b}" for b in range(len(group.buckets))]
                # A group of one rank gathers nothing: megatron's no-op copy stays exact.
                compressed = bool(self.bits) and group.intra_distributed_optimizer_instance_size > 1
                if compressed:
                    # The fused kernels where the gradients use them (C++ on CPU, Triton on CUDA).
                    self._kernels = param_kernels(loco.loco_kernels)
                    self._make_shards(group, keys, loco.loco_block_size,
                                      QuantOptions(**loco.param_gather_options(), seed=loco.loco_quant_seed))
                group.start_param_sync = self._make_start_param_sync(group, keys, compressed)
        if self.shards:
            self._wrap_steps(optimizer)

    def _make_shards(self, group, keys, block_size: int, options: QuantOptions) -> None:
        world = group.intra_distributed_optimizer_instance_size
        rank = group.intra_distributed_optimizer_instance_rank
        for key, bucket in zip(keys, group.buckets):
            data = bucket.param_data
            # stream: the bucket's share of the stochastic-rounding key (crc32: the same in
            # every process, unlike hash()).
            layout = DeltaLayout(data.numel(), world, self.bits, block_size, kernels=self._kernels,
                                 options=options, stream=zlib.crc32(key.encode()))
            # fp32 params: megatron's distributed optimizer steps the model buffer itself
            # (its main params are views of it); other dtypes get separate fp32 mains.
            self.shards[key] = AgreedShard(data.view(world, layout.shard)[rank],
                                           main_aliased=data.dtype == torch.float32)
            self._layouts[key] = layout
            self._buckets[key] = bucket

    def _wrap_steps(self, optimizer) -> None:
        wrapped = set()
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            mine = {id(b) for buffer in getattr(opt, "buffers", []) for b in buffer.buckets}
            shards = [self.shards[k] for k, b in self._buckets.items() if id(b) in mine]
            if shards:
                opt.step_with_ready_grads = self._make_step(opt.step_with_ready_grads, shards)
                wrapped.update(id(s) for s in shards)
        if len(wrapped) != len(self.shards):
            raise ValueError("--param-gather-bits: a gathered bucket belongs to no distributed optimizer")

    @staticmethod
    def _make_step(original, shards: list):
        def step_with_ready_grads() -> bool:
            for shard in shards:
                shard.begin_step()
            ok = original()
            if not ok:
                for shard in shards:
                    shard.cancel_step()
            return ok

        return step_with_ready_grads

    def _make_start_param_sync(self, group, keys, compressed: bool):
        original = group.start_param_sync  # the bound megatron method
        # A group of one rank gathers nothing over the wire: 0 bytes, as the gradient side
        # counts its one-rank groups (EP = DP leaves expert groups of one; DP = 1).
        alone = dist.get_world_size(group.intra_distributed_optimizer_instance_group) == 1
        raw = 0 if alone else sum(b.param_data.numel() * b.param_data.element_size() for b in group.buckets)

        def start_param_sync(force_sync: bool = False):
            if not compressed:
                if not (force_sync and group.param_gather_handle is not None):
                    self.stats.add_param_bytes(raw, raw)  # a new gather is issued
                return original(force_sync=force_sync)
            # megatron's own contract (param_and_grad_buffer.start_param_sync)
            if force_sync:
                if group.param_gather_handle is not None:
                    group.param_gather_handle.wait()
                    group.param_gather_handle = None
                    return
            else:
                assert group.param_gather_handle is None
            if self.shards[keys[0]].pending:
                self._launch(group, keys, raw, async_op=group.ddp_config.overlap_param_gather and not force_sync)
            group.param_gather_dispatched = True

        return start_param_sync

    def _launch(self, group, keys: list, raw: int, async_op: bool) -> None:
        comm = group.intra_distributed_optimizer_instance_group
        works, sent = [], 0
        for bucket, key in zip(group.buckets, keys):
            work, nbytes = compressed_param_all_gather(bucket.param_data, self.shards[key], self._layouts[key], comm,
                                                       async_op=async_op, clock=self.stats.clock, ops=self._ops)
            works.append(work)
            sent += nbytes
        self.stats.add_param_bytes(sent, raw)
        handle = _GroupWork(works, self.stats)
        if async_op:
            group.param_gather_handle = handle
        else:
            handle.wait()
            group.param_gather_handle = None

    @staticmethod
    def check_finite(nonfinite: float, iteration: int) -> None:
        """Fail loudly once a non-finite update was withheld from the agreed params."""
        if nonfinite > 0:
            raise NonFiniteParamUpdate(
                f"--param-gather-bits: a non-finite parameter update (the optimizer's main weights are "
                f"NaN/Inf) was withheld from the model weights before iteration {iteration}; stopping")

    def memory_report(self) -> dict:
        """This rank's memory for the compressed gather, in bytes: ``persistent`` (the agreed
        or exact-main copy of its own shard of every bucket: ``element_size / DP`` per
        parameter), ``transient`` (at most, during a gather: every bucket's wire rows, which
        may all be in flight at once with --overlap-param-gather, plus one chunk's encode or
        decode temporaries) and ``params`` (elements gathered compressed)."""
        persistent = sum(s.spare.numel() * s.spare.element_size() for s in self.shards.values())
        wire = sum(lay.transient_bytes() - lay.chunk_temp_bytes() for lay in self._layouts.values())
        chunk = max((lay.chunk_temp_bytes() for lay in self._layouts.values()), default=0)
        return {"persistent": persistent, "transient": wire + chunk,
                "params": sum(lay.numel for lay in self._layouts.values())}

    # -- checkpointing: the spare shard of every bucket ---------------------------------
    def state_dict(self) -> dict:
        return {key: s.state_dict() for key, s in self.shards.items()}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """Restore every bucket's spare shard - after the model (and optimizer) were loaded.

        When the checkpoint's state cannot be used here (``None``: written under another
        parallel layout, which the loader's one layout line announces; empty: written with
        --param-gather-bits 0; other buckets, e.g. another --ddp-bucket-size; another
        parameter dtype), the loaded model becomes the agreed parameters on every rank, and
        one line says so. Its weights are the agreed ones every rank computed with, so the
        ranks stay bit-identical; an fp32 model loses only the exact main weights' last
        unsent update."""
        if not self.shards:
            if sd:
                self._log("--param-gather-bits: off (or nothing to gather) in this run: the checkpoint's "
                          "agreed-parameter state is not used")
            return
        why = None
        if sd is None:  # another parallel layout: the loader's one layout line says so
            for shard in self.shards.values():
                shard.agree_on_model()
            return
        if not sd:
            why = "it was written without --param-gather-bits"
        elif set(sd) != set(self.shards):
            why = f"its buckets differ ({len(sd)} saved, {len(self.shards)} here: another --ddp-bucket-size?)"
        else:
            bad = next((k for k, s in self.shards.items() if not s.fits(sd[k])), None)
            if bad is not None:
                why = f"{bad} has another size or parameter dtype"
        if why is None:
            for key, shard in self.shards.items():
                shard.load_state_dict(sd[key])
            return
        for shard in self.shards.values():
            shard.agree_on_model()
        self._log(f"--param-gather-bits: the checkpoint's agreed-parameter state does not fit this run ({why}); "
                  f"the loaded model is the agreed parameters")
