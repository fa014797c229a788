"""The one error hierarchy of jitserve.

Every error a user can cause or see derives from :class:`JitServeError` and
carries the HTTP status that the server maps it to; the CLI prints its
message on one line.
"""


class JitServeError(Exception):
    """Base class: a message meant for the user plus the HTTP status for it."""

    http_status = 500


class BadRequestError(JitServeError):
    """The request itself is malformed (names, ranks, dtypes, data)."""

    http_status = 400


class ShapeOutOfRangeError(BadRequestError):
    """A request dimension has no bucket under the axis policy."""


class UnauthorizedError(JitServeError):
    """A model-changing call without the admin bearer token."""

    http_status = 401


class NotFoundError(JitServeError):
    http_status = 404


class ConflictError(JitServeError):
    http_status = 409


class PayloadTooLargeError(JitServeError):
    http_status = 413


class InsufficientMemoryError(JitServeError):
    """An upload whose weights would not fit in the server's memory beside the models it serves."""

    http_status = 507


class InvalidModelError(JitServeError):
    """The uploaded bytes are not a model jitserve can serve."""

    http_status = 422


class UnavailableError(JitServeError):
    """A bounded resource (compile queue, inference pool) is full."""

    http_status = 503


class CompileError(JitServeError):
    """A compile failed: import, lowering, codegen, crash or timeout."""

    http_status = 500


class UnsupportedOperatorError(CompileError):
    """TVM's ONNX importer has no converter for some operator of the model."""


class CompileCrashedError(CompileError):
    """The compile child process died without answering (e.g. a segfault)."""


class CompileOutOfMemoryError(CompileError):
    """The compile child passed its memory limit; the same compile would pass it again."""


class CompileTimeoutError(CompileError):
    """The compile child process ran past its time limit and was killed."""


class IllegalTransitionError(JitServeError):
    """A bucket asked to move between lifecycle states that are not connected: a bug, never the user's fault."""

    http_status = 500
