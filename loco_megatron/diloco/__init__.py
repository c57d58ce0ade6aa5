"""DiLoCo and Streaming DiLoCo on megatron-core, with LoCo's error-compensated outer gradients.

R replicas (``--diloco-replicas``) each train a complete TP x PP x DP layout with
megatron-core's distributed optimizer, syncing gradients every step inside the replica
only. Every H steps (``--diloco-inner-steps``), per fragment of the model
(``--diloco-fragments``), each rank forms the *outer gradient* on its own shard of the
fp32 main parameters, ``delta = agreed - local``; the R ranks holding that shard in the
R replicas average it (:mod:`.exchange`), and an outer Nesterov SGD updates the agreed
parameters, which the local ones then take (:mod:`.outer_math`)::

    m      <- mu * m + mean(delta)
    agreed <- agreed - lr * (mean(delta) + mu * m)
    local  <- alpha * local + (1 - alpha) * agreed        (alpha = 0 unless tau > 0)

Modules, in data-flow order: :mod:`.layout` (which ranks form a replica and an outer
group), :mod:`.schedule` (which fragment starts, exchanges and applies at which step),
:mod:`.fragments` (which parameter belongs to which fragment), :mod:`.outer_math` (the
pure tensor maths), :mod:`.exchange` (the collectives, with a work handle) and
:mod:`.outer` (the state and the per-step driver). The megatron-core internals it needs
(the distributed optimizer's shards, the gradient scaling) are reached only through
:mod:`loco_megatron.loco.hooks.diloco`.
"""
