"""LoCo: low-bit gradient communication with error compensation (arXiv 2407.04480).

Public API: :func:`quantize_blockwise`, :func:`dequantize_blockwise`,
:class:`QuantOptions` (their optional quantiser options), :class:`LoCoCompressor`. The collectives live in :mod:`.collectives`, the megatron
wiring in :mod:`.hooks`.
"""

from loco_megatron.loco.compressor import LoCoCompressor
from loco_megatron.loco.quantize import QuantOptions, dequantize_blockwise, quantize_blockwise

__all__ = ["LoCoCompressor", "QuantOptions", "quantize_blockwise", "dequantize_blockwise"]
