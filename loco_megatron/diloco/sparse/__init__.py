"""SparseLoCo: DiLoCo's outer gradients sent sparse, at a few bits, with error feedback
(arXiv 2508.15706).

Each replica keeps an error-feedback buffer per channel, sends only the top ``k`` entries of
each chunk of it (square tiles of 2-D weights, flat chunks elsewhere), their values through a
2-bit (or 4-, 8-bit, or fp32) bin table and their indices packed at ``ceil(log2 C)`` bits, and
keeps what it did not send for later. Modules, in data-flow order: :mod:`.chunks` (the
chunks of a shard), :mod:`.codec` (top-k, quantiser, packing, the payload), :mod:`.compressor`
(the error buffer and the encoding step) and :mod:`.channel` (the all-gather, with
:class:`~loco_megatron.diloco.exchange.OuterChannel`'s interface). All but the channel are
pure tensor functions.
"""
