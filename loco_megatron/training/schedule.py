"""The LR schedule on a resume: whose value wins where this run's differs from the checkpoint's.

megatron's ``OptimizerParamScheduler`` saves its max/min LR, warmup and decay lengths, decay
style and weight decay, and by default (megatron-core's ``use_checkpoint_opt_param_scheduler``)
silently keeps them on a resume: a new ``--lr`` or a longer ``--train-iters`` did nothing.
The rule here, per value:

* ``--override-opt-param-scheduler`` (Megatron-LM's flag): this run's value, whatever its source
  (command line, ``--config`` file, default).
* ``--use-checkpoint-opt-param-scheduler`` (Megatron-LM's flag): the checkpoint's value.
* Neither (Megatron-LM would assert that they match): a value whose flag is on this run's
  command line wins; any other keeps the checkpoint's, so a resume need not repeat the
  first run's flags. The decay length counts as given when ``--lr-decay-iters`` is, or when
  it is unset (decay = ``--train-iters``) and ``--train-iters`` is: extending ``--train-iters``
  then extends the decay. The warmup counts as given with ``--lr-warmup-iters`` or
  ``--lr-warmup-fraction``, or when it is a fraction of a decay length that counts as given.

Whenever a value differs, one line (rank 0) names each, both values and which one wins.
:func:`check_train_iters` decides what a ``--train-iters`` at or below the loaded iteration does.
"""

from __future__ import annotations

import pathlib

from loco_megatron.config import Config, ConfigError

OVERRIDE = "--override-opt-param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt-param-scheduler"


def _items(config: Config) -> list[tuple[str, str, bool]]:
    """(scheduler state key, what the console calls it, whether this run's command line sets it)."""
    o, given = config.optimizer, set(config.command_line)
    derived_decay = o.lr_decay_iters is None
    decay_given = "lr_decay_iters" in given or (derived_decay and "train_iters" in given)
    warmup_given = bool({"lr_warmup_iters", "lr_warmup_fraction"} & given) or (
        o.lr_warmup_fraction is not None and decay_given)
    return [
        ("max_lr", "--lr", "lr" in given),
        ("min_lr", "--min-lr", "min_lr" in given),
        ("lr_warmup_steps", "--lr-warmup-fraction x decay iterations" if o.lr_warmup_fraction is not None
         else "--lr-warmup-iters", warmup_given),
        ("lr_decay_steps", "LR decay iterations (--train-iters)" if derived_decay else "--lr-decay-iters",
         decay_given),
        ("lr_decay_style", "--lr-decay-style", "lr_decay_style" in given),
        ("start_wd", "--weight-decay", "weight_decay" in given),
    ]


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def reconcile(ours: dict, saved: dict, config: Config) -> tuple[dict, str]:
    """The scheduler state to resume with (``ours``: the freshly built scheduler's
    ``state_dict()``, ``saved``: the checkpoint's), and the one console line (empty when
    nothing differs). Raises ConfigError when the mix is not a valid schedule."""
    o = config.optimizer
    merged, parts = dict(saved), []
    for key, label, given in _items(config):
        if o.override_opt_param_scheduler:
            take_ours, why = True, OVERRIDE
        elif o.use_checkpoint_opt_param_scheduler:
            take_ours, why = False, USE_CHECKPOINT
        else:
            take_ours, why = given, ("given on the command line" if given else
                                     f"not on the command line; {OVERRIDE} would take it")
        merged[key] = ours[key] if take_ours else saved[key]
        if ours[key] != saved[key]:
            mine, theirs = _show(ours[key]), _show(saved[key])
            parts.append(f"{label}: this run's {mine} replaces the checkpoint's {theirs} ({why})" if take_ours
                         else f"{label}: the checkpoint's {theirs} is kept, not this run's {mine} ({why})")
    # Weight decay is one value (start = end); its increment length follows the decay length.
    merged["end_wd"] = merged["start_wd"]
    merged["wd_incr_steps"] = merged["lr_decay_steps"]
    merged["wd_incr_style"] = ours["wd_incr_style"]
    hint = f"give both on the command line, or {OVERRIDE}"
    if merged["min_lr"] > merged["max_lr"]:
        raise ConfigError(f"--min-lr: resuming with --lr {merged['max_lr']:g} and the checkpoint's --min-lr "
                          f"{merged['min_lr']:g} (or the reverse) puts the minimum above the peak; {hint}")
    if merged["lr_warmup_steps"] >= merged["lr_decay_steps"]:
        raise ConfigError(f"--lr-warmup-iters: resuming with {merged['lr_warmup_steps']} warmup and "
                          f"{merged['lr_decay_steps']} decay iterations (one from the checkpoint): the warmup "
                          f"must be shorter; {hint}")
    return merged, ("LR schedule on resume: " + "; ".join(parts)) if parts else ""


class ResumedSchedule:
    """Checkpointable view of megatron's scheduler that applies :func:`reconcile` on load.
    Register it after the optimizer: a torch-format load restores the optimizer's param
    groups, whose ``max_lr``/``min_lr`` megatron's ``get_lr`` prefers to the scheduler's."""

    def __init__(self, scheduler, config: Config):
        self.scheduler, self.config = scheduler, config
        self.note = ""
        """The console line about differing values after a load ("" if none)."""

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, saved: dict) -> None:
        s = self.scheduler
        merged, self.note = reconcile(s.state_dict(), saved, self.config)
        # merged already holds the winners: megatron's own check must take them as they are.
        s.use_checkpoint_opt_param_scheduler, s.override_opt_param_scheduler = True, False
        s.load_state_dict(merged)
        for group in s.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = s.max_lr, s.min_lr
        s.step(increment=0)  # this step's lr and weight decay from the settled values


def check_train_iters(train_iters: int, loaded: int, path: pathlib.Path) -> None:
    """A --train-iters below the loaded iteration is a mistake (exit 2: nothing would train,
    and the run would end behind its own checkpoint); equal to it, the run is complete:
    it says so and ends (exit 0, nothing re-saved), so re-running a finished job is harmless."""
    if train_iters < loaded:
        error = ConfigError(f"--train-iters {train_iters} is below iteration {loaded} of the checkpoint it "
                            f"resumes from ({path}): nothing to train; raise --train-iters to continue")
        error.agreed = True  # every rank loaded the same iteration: printed once
        raise error
