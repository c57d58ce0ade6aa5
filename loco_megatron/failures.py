"""A run that cannot go on: :class:`RunAborted`, whose message is the one line the run ends
with (exit code 3; bad input is :class:`~loco_megatron.config.ConfigError`, exit code 2).
Low in the layers so that every part that can end a run (the trainer, DiLoCo's elastic
cycles) raises the same class."""


class RunAborted(RuntimeError):
    """The run cannot usefully continue; the message is the one line to print."""

    agreed = True
    """Every rank raises it at the same step (from values agreed that step: all-reduced, or
    an elastic DiLoCo cycle's), so rank 0 prints it
    (:func:`loco_megatron.error_report.report_error`)."""
