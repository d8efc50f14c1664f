"""User-facing errors: each names the bad value and the fix; the CLI prints them on one line."""


class ThunderpoolError(Exception):
    """An error caused by user input or environment, shown without a traceback."""


class ModelError(ThunderpoolError):
    """The model path, files or architecture cannot be used."""


class ShardingError(ThunderpoolError):
    """The requested parallel layout cannot be built for this model."""


class LaunchError(ThunderpoolError):
    """Rank processes failed to start, crashed, or timed out."""


class UnverifiedLayoutError(ShardingError):
    """A sharded layout not yet proven equal to the unsharded model for this family."""
