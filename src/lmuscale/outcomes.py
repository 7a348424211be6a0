"""TEMPORARY (lead's branch): replaced by the exit-code table at merge."""


class ConfigError(ValueError):
    """A config key or value that is wrong."""


class WorkdirBusy(RuntimeError):
    """Another process holds the workdir's lock."""


class DamagedFile(RuntimeError):
    """A run folder's file that does not parse."""


class TrainingDiverged(RuntimeError):
    """The loss or the parameters became NaN or infinite."""
