"""How a run that started ends badly: what the driver raises, each with the command that finishes the
job. (A run refused before it starts is a `config.ConfigError`; a run another driver holds, a
`lease.RunBusy`.)"""


class RunFailed(RuntimeError):
    """Training did not finish; the message says why, where the checkpoints are and how to resume."""


class RunInterrupted(RunFailed):
    """Training was stopped (Ctrl-C, or the run was aborted) before its last epoch."""


class RegistrationFailed(RunFailed):
    """Training finished and its checkpoints are safe, but the model could not be registered (the
    tracking server went away, say); `raytrain-ddp register <run>` finishes the job later."""
