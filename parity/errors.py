"""Exception types that separate a user's mistake (exit 2) from a parity failure (exit 1)."""


class ParityError(Exception):
    """Base class for errors raised by parity."""


class UsageError(ParityError, ValueError):
    """The input was unusable: bad arguments, a bad config file, a damaged bundle.

    The CLI prints ``str(err)`` as a single line on stderr and exits with status 2. Messages must
    name the offending thing (the file, the argument, the layer) and the problem.
    """


class BundleError(UsageError):
    """A golden bundle is missing, truncated, corrupted or of an unknown schema."""
