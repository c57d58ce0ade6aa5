"""Elastic DiLoCo on torchft: replicas as jobs of their own that fail, leave and rejoin.

Each replica is one torchrun job with its own megatron world (TP x PP x inner DP), which
may differ from the other replicas'. The outer state lives in *lanes* (:mod:`.lanes`): a
partition of the model that depends on the model alone, lane ``j`` of --diloco-outer-ranks
hosted by one rank of each replica. Every lane host runs a torchft ``Manager`` on its
job's store; the host of lane j of each live replica meets the others' in a process group
torchft builds anew for each quorum, which a ``Lighthouse`` (``torchft_lighthouse``,
:mod:`.lighthouse`) forms from the replicas asking at that moment.

One *cycle* per outer step, the same program order on every rank of every replica:
:mod:`.coordinator` runs the protocol (quorum, heal, fingerprints, votes, commit),
:mod:`.cycle` decides from the gathered fingerprints what the cycle does, :mod:`.agreement`
makes replicas whose models differ take one, :mod:`.split` shares each step's global batch
among the live replicas, :mod:`.ops` carries the collectives over torchft's groups, and
:mod:`.step` drives it all from the training loop (:mod:`.setup` builds it). A replica's
state between cycles is :mod:`.replica`'s; what its ranks must hold alike travels as one
record (:mod:`.record`); :mod:`.saved` is its checkpoint, :mod:`.final` the run's final
outer step, :mod:`.waits` what it says while it waits on the others. The one-job mode
(every replica in one torchrun world) is :mod:`loco_megatron.diloco.outer`.
"""
