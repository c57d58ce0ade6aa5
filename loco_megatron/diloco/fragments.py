"""Which fragment of Streaming DiLoCo each parameter belongs to (pure: names and numbers in,
fragment indices out).

Fragments are runs of consecutive transformer layers: layer ``l`` (1-based, global over
pipeline stages and virtual chunks) of ``L`` goes to fragment ``(l - 1) * F // L``. The
embedding belongs to the first fragment, the final norm and the output layer to the last,
except a tied output layer (``--untie-embeddings-and-output-weights`` not given, on a
pipeline stage other than the embedding's): it is the embedding's copy, so it syncs with
the embedding's fragment, or the two copies would drift apart.
"""

from __future__ import annotations

from typing import Optional


def fragment_of(name: str, layer_number: Optional[int], shared_embedding: bool, num_layers: int,
                fragments: int) -> int:
    """Fragment index of parameter ``name`` (its module path inside the GPT model).

    ``layer_number``: the global 1-based number of the transformer layer holding it, None
    outside the layers; ``shared_embedding``: megatron's mark on the word embedding and its
    tied output-layer copy."""
    if shared_embedding or name.startswith("embedding."):
        return 0
    if layer_number is not None:
        if not 1 <= layer_number <= num_layers:
            raise ValueError(f"{name}: layer {layer_number} is not in 1 ... {num_layers}")
        return (layer_number - 1) * fragments // num_layers
    return fragments - 1
