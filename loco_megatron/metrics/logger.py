"""The run's one metrics sink: console line, JSON-lines file, wandb. Rank 0 only.

Keys are namespaced (``train/…``, ``eval/…``, ``comm/…``, ``loco/…``, ``mem/…``).
wandb is imported only when ``--wandb-project`` is set, and runs offline (a local
run directory that ``wandb sync`` uploads later) when there is no API key or
``WANDB_MODE=offline``, so a run never blocks on the network.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import secrets
from typing import Callable, Optional

from loco_megatron.config import ConfigError, LoggingConfig


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _wandb_run_id(path: Optional[pathlib.Path]) -> Optional[str]:
    """The run id kept in ``path`` (written there by the first start), or None when
    there is nowhere to keep one (no --save: nothing resumes, so neither does wandb)."""
    if path is None:
        return None
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)  # wandb's own ids are 8 characters of [a-z0-9] too
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)  # atomic: a crash leaves the old id or the new one, never half of it
    return run_id


class MetricsLogger:
    """``wandb_dir``: wandb's folder when ``--wandb-save-dir`` is not given (the launcher's
    ``WANDB_DIR``; else ``./wandb``). ``wandb_id_file``: where the wandb run id is kept
    (next to the checkpoints), so a requeued or restarted job that resumes the checkpoint
    also resumes its wandb run instead of starting a new one."""

    def __init__(self, cfg: LoggingConfig, run_config: dict, enabled: bool, wandb_offline: bool,
                 print_fn=print, wandb_dir: Optional[str] = None, wandb_id_file: Optional[pathlib.Path] = None):
        self.enabled, self.print = enabled, print_fn
        self._jsonl = None
        self._wandb = None
        self._tensorboard = None
        if not enabled:
            return
        if cfg.metrics_jsonl:
            path = pathlib.Path(cfg.metrics_jsonl)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(path, "a", buffering=1)
            self._jsonl.write(json.dumps({"config": run_config}) + "\n")
        if cfg.wandb_project:
            import wandb

            save_dir = cfg.wandb_save_dir or wandb_dir or "wandb"
            pathlib.Path(save_dir).mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                id=_wandb_run_id(wandb_id_file), resume="allow",
                project=cfg.wandb_project, name=cfg.wandb_exp_name, group=cfg.wandb_group,
                tags=[t for t in (cfg.wandb_tags or "").split(",") if t] or None,
                dir=save_dir, config=run_config, mode="offline" if wandb_offline else "online",
                settings=wandb.Settings(init_timeout=60, silent=True),
            )
            self._wandb.define_metric("train/tokens_seen")
            self._wandb.define_metric("train/lm_loss_vs_tokens", step_metric="train/tokens_seen")
        self._tensorboard = None
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--tensorboard-dir: the tensorboard package is not installed "
                                  "(pip install -r requirements-tensorboard.txt)") from None
            self._tensorboard = SummaryWriter(log_dir=cfg.tensorboard_dir)

    def log(self, iteration: int, metrics: dict, total_iters: Optional[int] = None) -> None:
        if not self.enabled:
            return
        if self._jsonl:
            self._jsonl.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        if self._wandb is not None:
            extra = {}
            if "train/lm_loss" in metrics:
                extra["train/lm_loss_vs_tokens"] = metrics["train/lm_loss"]
            self._to_wandb(lambda run: run.log({**metrics, **extra}, step=iteration))
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, iteration)
        self.print(self._line(iteration, metrics, total_iters), flush=True)

    def summary(self, iteration: int, metrics: dict) -> None:
        """The end-of-run ``summary/...`` figures: one JSON-lines record, wandb's run summary
        and TensorBoard scalars; no console line (the trainer prints the summary block)."""
        if not self.enabled:
            return
        if self._jsonl:
            self._jsonl.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        if self._wandb is not None:
            self._to_wandb(lambda run: run.summary.update(metrics))
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, iteration)

    @staticmethod
    def _line(it: int, m: dict, total: Optional[int]) -> str:
        parts = [f"iter {it}" + (f"/{total}" if total else "")]
        if "ckpt/iteration" in m:  # a save: the time training waited, the time until it was on disk
            parts.append(f"checkpoint {m['ckpt/iteration']}"
                         + (f" blocked {m['ckpt/blocking_s']:.2f}s" if "ckpt/blocking_s" in m else "")
                         + (f" written {m['ckpt/write_s']:.2f}s" if "ckpt/write_s" in m else "")
                         + (f" loaded {m['ckpt/load_s']:.2f}s" if "ckpt/load_s" in m else ""))
        if "train/lm_loss" in m:
            parts += [f"loss {m['train/lm_loss']:.4f}", f"lr {m['train/lr']:.2e}",
                      f"grad norm {m['train/grad_norm']:.3f}", f"tokens/s {m['train/tokens_per_s']:.0f}",
                      f"step {m['train/step_s']:.3f}s"]
            if "train/tflops_per_device" in m:
                parts.append(f"TFLOP/s/device {m['train/tflops_per_device']:.3f}"
                             + (f" (MFU {100 * m['train/mfu']:.1f}%)" if "train/mfu" in m else ""))
            if "comm/grad_sync_total_s" in m:
                parts.append(f"comm {m['comm/grad_sync_total_s'] * 1e3:.1f}ms "
                             f"(exposed {m['comm/grad_sync_exposed_s'] * 1e3:.1f}ms, "
                             f"x{m['comm/compression_ratio']:.3f} bytes)")
            if m.get("diloco/window_outer_steps"):  # DiLoCo: this line's window applied outer step(s)
                n = int(m["diloco/window_outer_steps"])
                parts.append(f"outer step{'' if n == 1 else f's x{n}'} {m['diloco/outer_step_bytes_sent'] / 2**20:.2f} "
                             f"MiB/rank (exposed {m['diloco/outer_step_exposed_s'] * 1e3:.1f}ms"
                             f"{'' if n == 1 else ' each'})")
            if total:
                parts.append(f"ETA {_fmt_eta((total - it) * m['train/step_s'])}")
            if m.get("train/skipped_iters"):
                parts.append(f"skipped {int(m['train/skipped_iters'])}")
        elif "train/skipped_iters" in m:
            parts.append(f"no loss: every step skipped (NaN/Inf) | skipped {int(m['train/skipped_iters'])}")
        if "eval/lm_loss" in m:
            parts += [f"eval loss {m['eval/lm_loss']:.4f}", f"eval ppl {m['eval/ppl']:.2f}"]
        return " | ".join(parts)

    def _to_wandb(self, call: Callable) -> None:
        """``call(run)``. wandb's service process (``wandb-core``) exits on SIGTERM, and
        Slurm sends SIGTERM to every process of the job (scancel, preemption), so on a
        stop the rank can lose its service while it saves: that must not cost the save.
        The first failed call prints one line and turns wandb off for the rest of the run;
        the metrics go on to the other sinks."""
        try:
            call(self._wandb)
        except Exception as e:  # ConnectionResetError, BrokenPipeError, ... from the service's socket
            self._wandb = None
            self.print(f"warning: wandb's service process is gone ({type(e).__name__}: {e}): wandb logging "
                       "stops here, the run goes on", flush=True)
            import wandb

            with contextlib.suppress(Exception):
                wandb.teardown()  # unregisters wandb's exit hook, which would fail the same way at exit

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._wandb is not None:
            self._to_wandb(lambda run: run.finish())
        if self._tensorboard is not None:
            self._tensorboard.close()
