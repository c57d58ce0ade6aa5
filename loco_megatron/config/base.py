"""What every config module shares: the error type, the check helper, and the flags that
replace each other."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad flag or config value. The message names the flag."""


ALTERNATIVES = {"lr_warmup_iters": ("lr_warmup_fraction", None), "lr_warmup_fraction": ("lr_warmup_iters", 0)}
"""Flags that replace each other: setting one on the command line resets the other (to the
given value) when it came from the config file."""


def require(cond: bool, flag: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"--{flag.replace('_', '-')}: {msg}")
