"""The errors nestfed raises for bad input. The CLI prints them as one line and exits 2."""


class NestfedError(Exception):
    """Base class: a user-facing error whose message names the file, key or client at fault."""


class ConfigError(NestfedError):
    """A config file, section, key or value is wrong."""


class DataError(NestfedError):
    """A data path is missing or a data file is malformed."""


class UpdateRejected(NestfedError):
    """A client update failed validation (NaN/Inf, keys, shapes, rank); it is dropped."""
