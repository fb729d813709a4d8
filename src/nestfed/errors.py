"""The errors nestfed raises for bad input. The CLI prints them as one line and exits 2."""


class NestfedError(Exception):
    """Base class: a user-facing error whose message names the file, key or client at fault."""


class ConfigError(NestfedError):
    """A config file, section, key or value is wrong."""


class DataError(NestfedError):
    """A data path is missing or a data file is malformed."""


class UpdateRejected(NestfedError):
    """A client update failed validation (NaN/Inf, keys, shapes, rank); it is dropped."""


class RunFailed(NestfedError):
    """A run stopped: its global model was destroyed, or nothing has aggregated for too long.

    summary.json records ``outcome = "failed"`` and the reason; no adapter is exported.

    Args:
        message: the reason, naming what failed.
        round: the round at fault (kept as the ``round`` attribute).
    """

    def __init__(self, message: str, round: int):
        super().__init__(message)
        self.round = round
