"""Engine error types: each names the problem so callers can map it to a status code."""


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file, has a malformed one, or uses an unsupported architecture."""


class IllegalTransition(RuntimeError):
    """A request state change that the transition table does not allow."""


class RequestRejected(ValueError):
    """A request that can never be served (e.g. its prompt exceeds the context)."""
