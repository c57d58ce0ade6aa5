"""DiLoCo settings: replicas that synchronise every H steps (see :mod:`loco_megatron.config`
and :mod:`loco_megatron.diloco`)."""

from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Optional

from loco_megatron.config.base import check_choices, choice, require
from loco_megatron.diloco.elastic.split import MODES as BATCH_SPLITS


def port_of(address: str) -> Optional[int]:
    """The port of ``http://HOST:PORT`` (None when it has none or it is not a number)."""
    try:
        return urllib.parse.urlsplit(address).port
    except ValueError:
        return None


@dataclasses.dataclass
class DiLoCoConfig:
    diloco_replicas: int = 0
    """DiLoCo: split the world into this many replicas (0 = off; 1 = one replica whose outer
    step is a lookahead over its own inner steps). Replica r is ranks
    r*W/R ... (r+1)*W/R - 1, whole nodes (or whole parts of one node): a complete
    TP x PP x DP layout that syncs its gradients every step as without DiLoCo (LoCo,
    two-hop and --param-gather-bits included); the replicas meet only every
    --diloco-inner-steps steps, in the outer step."""
    diloco_inner_steps: int = 32
    """H: inner optimizer steps between two outer steps of the same fragment."""
    diloco_outer_lr: Optional[float] = None
    """Outer learning rate: agreed <- agreed - lr * (Nesterov) update of the mean outer
    gradient (agreed - local parameters). Default: 0.4 at --diloco-inner-steps 16 or
    fewer, else 0.55 (the best LR of the sweep in docs/benchmarks.md grows with H); with
    --diloco-outer-topk 1.0 (SparseLoCo's reference setting, not measured here)."""
    diloco_outer_momentum: Optional[float] = None
    """Outer Nesterov momentum (0: plain averaging at --diloco-outer-lr 1). Default: 0.9;
    with --diloco-outer-topk 0 (SparseLoCo's plain SGD step: its error-feedback buffer
    takes the momentum's place)."""
    diloco_outer_bits: Optional[int] = choice(None, (0, 8, 4, 2))
    """Outer-gradient exchange: 0 = fp32 all-reduce (the reference); 8, 4 or 2 = LoCo's
    block quantiser (--loco-block-size, the quantiser options of that width) with error
    feedback, an all-to-all summed in fp32 in rank order, the mean re-quantised and
    all-gathered, so every replica decodes the same bits. With --diloco-outer-topk: the
    width of the values sent (2, 4 or 8 through SparseLoCo's bin table, 0 = fp32 values).
    Default: 4; with --diloco-outer-topk 2."""
    diloco_outer_topk: int = 0
    """SparseLoCo (arXiv 2508.15706): each replica keeps an error-feedback buffer
    ``e <- beta e + delta`` (--diloco-outer-beta), sends only the K entries of largest
    ``|e|`` of each chunk of --diloco-outer-chunk elements (their values at
    --diloco-outer-bits, their indices packed at ceil(log2 C) bits) in one all-gather, and
    keeps what it did not send. 0 = dense (the exchange --diloco-outer-bits describes)."""
    diloco_outer_chunk: int = 4096
    """SparseLoCo's chunk: elements per chunk of the error buffer, each sending
    --diloco-outer-topk of them; square tiles (64 x 64 at 4096) of 2-D weights where the
    side divides both dimensions, flat runs elsewhere."""
    diloco_outer_topk_mean: str = choice("chosen", ("chosen", "all"))
    """SparseLoCo's mean of the gathered entries: ``chosen`` divides each entry's sum by the
    replicas that sent that entry (weighted by their samples on unequal sites; Templar's
    merge); ``all`` by every replica, as the dense mean (an entry a replica did not send
    counts as its zero). docs/diloco.md gives the measurement behind the default."""
    diloco_outer_error_feedback: bool = True
    """Compensate each outer gradient with the moving average of its past compression
    errors (int8 storage, --diloco-outer-beta). --no-diloco-outer-error-feedback is the ablation."""
    diloco_outer_beta: Optional[float] = None
    """Moving-average factor of the outer compression error (LoCo's beta; 0 is classic
    error feedback: the whole remainder is sent with the next outer gradient). Default:
    0 at --diloco-outer-bits 2, else 0.8 (the forms measured best at each width,
    docs/diloco.md); with --diloco-outer-topk the decay of SparseLoCo's buffer, 0.95 (its
    reference setting, not measured here)."""
    diloco_outer_gain_correction: Optional[bool] = None
    """Refit each block's scale of the compressed outer exchange (both phases) so the
    decoded outer gradient is not shrunk towards zero: ``<decoded, sent> = |sent|^2`` per
    block. Costs no bytes; runs on LoCo's torch kernels. Default: on at --diloco-outer-bits
    2 (dense), else off."""
    diloco_fragments: int = 1
    """F: Streaming DiLoCo. The transformer layers are split into F fragments of
    consecutive layers (the embedding with the first, the output layer and final norm with
    the last); fragment f syncs H/F steps after fragment f-1, so one fragment's exchange
    is on the wire at a time."""
    diloco_sync_delay: int = 0
    """tau: start a fragment's exchange at its sync step and apply it tau inner steps
    later, overlapped with those steps (Streaming DiLoCo's overlap); at most the gap
    between two fragments' sync steps."""
    diloco_eager: bool = False
    """Eager updates (Kale et al., arXiv 2502.12996): each outer exchange runs during the
    next outer interval instead of stopping the replicas at the sync. At a fragment's sync
    the mean of the exchange started one interval earlier is applied to the agreed
    parameters, and each replica steps its own outer parameters with that mean, in which
    its fresh outer gradient stands in for its share of the mean still on the wire
    (docs/diloco.md, "Eager updates"). Applies to every fragment (elastic DiLoCo: one
    fragment); --diloco-sync-delay must be 0 (the exchange overlaps the whole interval
    already)."""
    diloco_eager_naive: bool = False
    """With --diloco-eager: the naive one-interval delay instead (the paper's control): the
    replicas step with the delayed mean alone, their fresh outer gradient never applied
    ahead of it."""
    diloco_link_gbps: Optional[float] = None
    """--dry-run: the link between replicas in Gbit/s; the dry run then says how long one
    outer exchange takes on it against the compute of an outer interval (at 40% MFU on
    H100s: docs/diloco.md, "What your link needs")."""
    diloco_mixing_factor: Optional[float] = None
    """alpha: at apply time, local <- alpha * local + (1 - alpha) * new agreed parameters
    (the tau steps taken meanwhile keep weight alpha). Default: 0.5 with
    --diloco-sync-delay > 0, else 0 (the replicas take the agreed parameters)."""

    diloco_lighthouse: Optional[str] = None
    """Elastic DiLoCo on torchft: the address of the run's torchft Lighthouse
    (``http://HOST:PORT``, started with ``torchft_lighthouse``). Each replica is then a
    job of its own (its own torchrun, its own TP x PP x DP world, --diloco-replica-id
    naming it) that fails, leaves and rejoins alone: a quorum decides who takes part in
    each outer step, and a (re)started replica heals from a live one. Unset: the
    --diloco-replicas replicas are one torchrun world."""
    diloco_replica_id: Optional[int] = None
    """Elastic DiLoCo: this job's replica, 0 ... --diloco-replicas - 1 (fixes its sample
    stream: replica r trains on the samples replica r of a one-world run would)."""
    diloco_min_replicas: int = 1
    """Elastic DiLoCo: the fewest live replicas that may take an outer step; with fewer the
    exchange is not applied and the replicas keep training on their own."""
    diloco_quorum_timeout_s: float = 900.0
    """Elastic DiLoCo: how long an outer step (or a joining replica) waits for the quorum:
    more than an outer interval (H steps) plus the slowest replica's lag, at least 10 s;
    after a failed attempt it counts from that failure."""
    diloco_exchange_timeout_s: float = 120.0
    """Elastic DiLoCo: the timeout of each collective between replicas, of the heal
    transfer and of the commit: what a replica dying inside an exchange costs the others
    at most before they discard that exchange and go on."""
    diloco_outer_ranks: Optional[int] = None
    """Elastic DiLoCo: over how many ranks of each replica its outer exchange runs, L. The
    outer state lives in L lanes, a partition of the model that does not depend on the
    layout (lane j on rank j*W/L of a replica of W ranks), so replicas of different
    TP x PP x DP layouts and sizes train one model; every replica must use the same L, at
    most its world size. Default: 1 (rank 0 of each replica holds the whole outer state,
    so replicas of any size meet); a model whose outer state (about 4 fp32 copies of the
    model) does not fit one rank needs more, at most the smallest replica's world size."""
    diloco_batch_split: str = choice("fixed", BATCH_SPLITS)
    """Elastic DiLoCo: how the live replicas share each step's global batch. fixed: replica
    r of R trains G/R samples (lockstep: the slowest replica sets the pace); weight: in
    proportion to --diloco-replica-weight; throughput: in proportion to the samples per
    second each replica measured over the last outer interval (re-split when that cuts the
    idle time). Every replica takes the same H inner steps and the outer mean is weighted by
    the samples each trained (docs/diloco.md, "Unequal sites")."""
    diloco_replica_weight: float = 1.0
    """Elastic DiLoCo: this replica's share of the global batch relative to the others'
    (for example its GPU count) under --diloco-batch-split weight, and its first share
    under throughput (before a speed is measured)."""

    def __post_init__(self):
        check_choices(self)
        if self.diloco_lighthouse is not None:
            require(self.diloco_lighthouse.startswith(("http://", "https://")) and port_of(self.diloco_lighthouse),
                    "diloco_lighthouse", f"{self.diloco_lighthouse!r} is not an address http://HOST:PORT")
            require(self.diloco_replicas >= 1, "diloco_lighthouse", "needs --diloco-replicas R (the replicas expected)")
            require(self.diloco_replica_id is not None, "diloco_replica_id",
                    f"must be given with --diloco-lighthouse (0 ... {self.diloco_replicas - 1})")
            require(0 <= self.diloco_replica_id < self.diloco_replicas, "diloco_replica_id",
                    f"{self.diloco_replica_id} is not in 0 ... {self.diloco_replicas - 1} (--diloco-replicas "
                    f"{self.diloco_replicas})")
            require(1 <= self.diloco_min_replicas <= self.diloco_replicas, "diloco_min_replicas",
                    f"{self.diloco_min_replicas} is not in 1 ... --diloco-replicas ({self.diloco_replicas})")
            # (a quorum that misses a replica of the last cycle is asked again 5 s later,
            # ElasticOuterStep.recheck_s: a shorter timeout ends the run at the first death)
            require(self.diloco_quorum_timeout_s >= 10, "diloco_quorum_timeout_s",
                    f"{self.diloco_quorum_timeout_s:g} s is below 10 s: a replica that dies would end the run (the "
                    f"live ones ask the lighthouse again 5 s after a quorum that misses it)")
            require(self.diloco_exchange_timeout_s > 0, "diloco_exchange_timeout_s",
                    f"{self.diloco_exchange_timeout_s} is not > 0")
            require(self.diloco_outer_ranks is None or self.diloco_outer_ranks >= 1, "diloco_outer_ranks",
                    f"{self.diloco_outer_ranks} is not >= 1")
            require(self.diloco_replica_weight > 0, "diloco_replica_weight",
                    f"{self.diloco_replica_weight} is not > 0")
            require(self.diloco_replica_weight == 1.0 or self.diloco_batch_split != "fixed", "diloco_replica_weight",
                    "needs --diloco-batch-split weight or throughput (fixed gives every replica G/R samples)")
        else:
            require(self.diloco_replica_id is None, "diloco_replica_id", "needs --diloco-lighthouse (elastic DiLoCo)")
            require(self.diloco_outer_ranks is None, "diloco_outer_ranks", "needs --diloco-lighthouse (elastic DiLoCo)")
            require(self.diloco_batch_split == "fixed", "diloco_batch_split",
                    f"{self.diloco_batch_split} needs --diloco-lighthouse (the replicas of one job are equal)")
        require(not self.diloco_eager or not self.diloco_sync_delay, "diloco_eager",
                f"overlaps the whole outer interval; --diloco-sync-delay {self.diloco_sync_delay} must be 0 with it")
        require(self.diloco_link_gbps is None or self.diloco_link_gbps > 0, "diloco_link_gbps",
                f"{self.diloco_link_gbps} is not > 0")
        # (the eager correction swaps this replica's share w of the late mean for its fresh
        # one; SparseLoCo's mean is per entry over the replicas that sent it: no fixed share)
        require(not (self.diloco_eager and self.diloco_outer_topk), "diloco_eager",
                f"does not compose with --diloco-outer-topk {self.diloco_outer_topk} yet (the sparse mean has no "
                "fixed share of each replica to swap); use a dense outer form with it")
        require(not self.diloco_eager_naive or self.diloco_eager, "diloco_eager_naive",
                "needs --diloco-eager (it is the eager exchange's naive control)")
        require(not (self.diloco_eager and self.elastic) or self.diloco_fragments == 1, "diloco_eager",
                f"with --diloco-lighthouse needs --diloco-fragments 1 (not {self.diloco_fragments}): an elastic "
                "cycle closes before the next opens, and an eager one stays open for the whole interval")
        # With tau 0 the replicas take the agreed parameters at once: mixing their own back
        # in would keep them apart for good (they never agree again).
        require(not self.diloco_mixing_factor or self.diloco_sync_delay > 0, "diloco_mixing_factor",
                f"{self.diloco_mixing_factor} needs --diloco-sync-delay > 0 (alpha mixes the steps taken while an "
                "exchange was in flight; with no delay the replicas must take the agreed parameters, alpha 0)")
        if self.diloco_mixing_factor is None:
            self.diloco_mixing_factor = 0.5 if self.diloco_sync_delay > 0 else 0.0
        sparse = self.diloco_outer_topk > 0
        require(self.diloco_outer_topk >= 0, "diloco_outer_topk", f"{self.diloco_outer_topk} is not >= 0")
        require(sparse or self.diloco_outer_chunk == 4096, "diloco_outer_chunk",
                "needs --diloco-outer-topk K > 0 (the chunks are SparseLoCo's)")
        require(self.diloco_outer_chunk >= 2, "diloco_outer_chunk", f"{self.diloco_outer_chunk} is not >= 2")
        require(self.diloco_outer_topk <= self.diloco_outer_chunk, "diloco_outer_topk",
                f"{self.diloco_outer_topk} is more than a chunk's {self.diloco_outer_chunk} elements "
                "(--diloco-outer-chunk)")
        require(sparse or self.diloco_outer_topk_mean == "chosen", "diloco_outer_topk_mean",
                "needs --diloco-outer-topk K > 0")
        require(not (sparse and self.diloco_outer_gain_correction), "diloco_outer_gain_correction",
                "refits LoCo's block scales; --diloco-outer-topk sends SparseLoCo's bin tables (no scales to refit)")
        if self.diloco_outer_bits is None:
            self.diloco_outer_bits = 2 if sparse else 4
        # SparseLoCo's reference settings (Templar's, arXiv 2508.15706): SGD at LR 1, the
        # error buffer in the momentum's place, decay 0.95.
        if self.diloco_outer_momentum is None:
            self.diloco_outer_momentum = 0.0 if sparse else 0.9
        # 2 bits: gain-corrected scales with classic error feedback measured best (the
        # moving average's damping costs more at 2 bits than the shrinkage it smooths).
        if self.diloco_outer_lr is None:
            self.diloco_outer_lr = 1.0 if sparse else default_outer_lr(self.diloco_inner_steps)
        if self.diloco_outer_beta is None:
            self.diloco_outer_beta = 0.95 if sparse else 0.0 if self.diloco_outer_bits == 2 else 0.8
        if self.diloco_outer_gain_correction is None:
            self.diloco_outer_gain_correction = self.diloco_outer_bits == 2 and not sparse
        require(self.diloco_replicas >= 0, "diloco_replicas", f"{self.diloco_replicas} is not >= 0")
        require(self.diloco_inner_steps >= 1, "diloco_inner_steps", f"{self.diloco_inner_steps} is not >= 1")
        require(self.diloco_outer_lr > 0.0, "diloco_outer_lr", f"{self.diloco_outer_lr} is not > 0")
        require(0.0 <= self.diloco_outer_momentum < 1.0, "diloco_outer_momentum",
                f"{self.diloco_outer_momentum} is not in [0, 1)")
        require(0.0 <= self.diloco_outer_beta < 1.0, "diloco_outer_beta", f"{self.diloco_outer_beta} is not in [0, 1)")
        require(1 <= self.diloco_fragments <= self.diloco_inner_steps, "diloco_fragments",
                f"{self.diloco_fragments} is not in 1 ... --diloco-inner-steps ({self.diloco_inner_steps})")
        require(self.diloco_inner_steps % self.diloco_fragments == 0, "diloco_fragments",
                f"{self.diloco_fragments} does not divide --diloco-inner-steps {self.diloco_inner_steps} (the "
                "fragments sync H/F steps apart, evenly)")
        gap = self.diloco_inner_steps // self.diloco_fragments
        require(0 <= self.diloco_sync_delay <= gap and self.diloco_sync_delay < self.diloco_inner_steps,
                "diloco_sync_delay", f"{self.diloco_sync_delay} is not in 0 ... {min(gap, self.diloco_inner_steps - 1)} "
                f"(the gap between two fragments' sync steps, --diloco-inner-steps / --diloco-fragments): "
                "one fragment's exchange at a time")
        require(0.0 <= self.diloco_mixing_factor < 1.0, "diloco_mixing_factor",
                f"{self.diloco_mixing_factor} is not in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.diloco_replicas > 0

    @property
    def sparse_outer(self) -> bool:
        """SparseLoCo's outer exchange (--diloco-outer-topk > 0)."""
        return self.diloco_outer_topk > 0

    @property
    def elastic(self) -> bool:
        """Replicas as jobs of their own, on torchft (--diloco-lighthouse)."""
        return self.diloco_lighthouse is not None

    @property
    def replicas_in_world(self) -> int:
        """Replicas inside this torchrun world: all of them, or (elastic) this job's one."""
        return 1 if self.elastic else self.diloco_replicas


def default_outer_lr(inner_steps: int) -> float:
    """--diloco-outer-lr's default for H = ``inner_steps``: what the outer-LR sweep
    (benchmarks/outer_lr.py, docs/benchmarks.md) measured best, 0.4 at H <= 16 and 0.55
    from H = 32 on (replicas 2 and 4 alike)."""
    return 0.4 if inner_steps <= 16 else 0.55
