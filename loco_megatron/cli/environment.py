"""What the launcher (torchrun, Slurm) tells a rank through the environment: the first
step of the data flow (CLI > config > set-up > train step > gradient/parameter sync >
checkpoint and metrics), read once at start-up into a frozen :class:`LaunchEnv` that set-up
and the trainer take as an argument."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Optional


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What torchrun (or Slurm) told this process through the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    cache_home: str = str(pathlib.Path.home() / ".cache")
    wandb_offline: bool = True
    wandb_dir: Optional[str] = None
    """WANDB_DIR: wandb's folder unless --wandb-save-dir is given (the Slurm templates
    point it into the run directory)."""
    triton_interpret: bool = False
    """TRITON_INTERPRET=1: Triton kernels run in its CPU interpreter (tests)."""
    init_method: str = "env://"
    """torch.distributed rendezvous: torchrun's env://, or a private TCP port for a
    single process started without torchrun."""
    distributed_timeout_s: Optional[float] = None
    """LOCO_DISTRIBUTED_TIMEOUT_S: collective timeout in seconds, overriding
    --distributed-timeout-minutes (hang drills and tests; not a flag on purpose)."""
    hf_hub_offline: bool = False
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: a hub tokenizer is read from the hub cache only."""
    error_file: Optional[str] = None
    """TORCHELASTIC_ERROR_FILE: where torchrun reads why this worker failed; its failure
    summary shows that text as the root cause (None: not started by torchrun)."""
    started_at: float = dataclasses.field(default_factory=time.time)
    """When this process started (seconds since the epoch): a --stop-file older than this
    is left over from an earlier job."""
    launcher_pid: Optional[int] = None
    """The torchrun agent that started this rank (TORCHELASTIC_RUN_ID set: it is the parent
    process), watched so the ranks stop when it dies; None without torchrun."""
    store_at: Optional[tuple[str, int]] = None
    """(MASTER_ADDR, MASTER_PORT): the TCP store of the job's process groups (``env://``);
    None without them."""
    agent_store: bool = False
    """TORCHELASTIC_USE_AGENT_STORE=True (torch's default): the torchrun agent hosts that
    store and shares it with its ranks, across restarts of the worker group; False: rank 0
    hosts it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the launchers set) or no torchrun."""
    restart_count: int = 0
    """TORCHELASTIC_RESTART_COUNT: how often this rank's torchrun agent has restarted its
    worker group (--max-restarts); 0 for the first start."""
    agents: int = 1
    """GROUP_WORLD_SIZE: the torchrun agents (nodes) of the job."""
    torchft_log: str = "error"
    """The log filter of torchft's Rust side (elastic DiLoCo): the user's RUST_LOG, else
    ``error`` (torchft would print several INFO lines per outer step; membership changes,
    heals and refusals are lines of this project's own)."""

    @classmethod
    def from_environ(cls, environ=os.environ) -> "LaunchEnv":
        def as_int(name: str, default: int) -> int:
            return int(environ.get(name, default))

        offline = environ.get("WANDB_MODE", "") in ("offline", "disabled") or not (
            environ.get("WANDB_API_KEY") or pathlib.Path.home().joinpath(".netrc").exists()
        )
        init_method = "env://"
        if "MASTER_ADDR" not in environ and as_int("WORLD_SIZE", 1) == 1:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        return cls(
            init_method=init_method,
            rank=as_int("RANK", 0),
            world_size=as_int("WORLD_SIZE", 1),
            local_rank=as_int("LOCAL_RANK", 0),
            local_world_size=as_int("LOCAL_WORLD_SIZE", 1),
            cache_home=environ.get("XDG_CACHE_HOME", str(pathlib.Path.home() / ".cache")),
            wandb_offline=offline,
            wandb_dir=environ.get("WANDB_DIR") or None,
            triton_interpret=environ.get("TRITON_INTERPRET", "") == "1",
            distributed_timeout_s=float(environ["LOCO_DISTRIBUTED_TIMEOUT_S"])
            if environ.get("LOCO_DISTRIBUTED_TIMEOUT_S") else None,
            hf_hub_offline=hf_hub_offline(environ),
            error_file=environ.get("TORCHELASTIC_ERROR_FILE") or None,
            launcher_pid=os.getppid() if environ.get("TORCHELASTIC_RUN_ID") else None,
            store_at=(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
            if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT") else None,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=as_int("TORCHELASTIC_RESTART_COUNT", 0),
            agents=as_int("GROUP_WORLD_SIZE", 1),
            torchft_log=environ.get("RUST_LOG") or "error",
        )


def hf_hub_offline(environ=os.environ) -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is 1/ON/YES/TRUE, as huggingface_hub reads it
    (for the tools, which share this module's reading of the environment)."""
    value = environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")
