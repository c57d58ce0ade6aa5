"""The megatron-core versions whose private internals :mod:`loco_megatron.loco.hooks`
matches, and the check that fails loudly outside them."""

from __future__ import annotations

from typing import Optional

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
