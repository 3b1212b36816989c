"""Every exception the package raises, in one module that imports nothing, so any layer can
raise them. ``UserError`` and its subclasses are mistakes a user can fix; their messages say
what to do, and the entry points (``cli.run``, ``serve.py``, the eval CLI) print them as one
line without a traceback. (The HTTP error envelope, ``serve.protocol.ApiError``, is a response
format, not an exception of the package, and lives with the server.)"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (bad path, wrong data, too-small mesh); printed without a traceback."""


class ConfigError(UserError, ValueError):
    """A configuration value or key the model does not accept. The message says what to change."""


class DataError(UserError, ValueError):
    """Missing, corrupt or mismatched data; the message says how to fix it."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, incomplete, or for another model; the message says what to do."""


class CheckpointFormatError(UserError, ValueError):
    """The directory is not an fla GLA checkpoint this package can load; the message says why."""


class DoesNotFitError(UserError, ValueError):
    """A sample's fixed parts (pairs, question) need more tokens than its context length."""


class InvalidParamError(UserError, ValueError):
    """A request field out of range; ``param`` names it (the HTTP layer answers 400 with it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class QueueFullError(Exception):
    """The serving engine's admission queue is full (or it is shutting down); retry later (HTTP 429)."""
