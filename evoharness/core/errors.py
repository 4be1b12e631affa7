"""One error type whose message is a single line naming what went wrong and where."""

from __future__ import annotations


class EvoError(Exception):
    """A user-facing failure: bad input, bad config, missing file, unreachable endpoint.

    The CLI prints ``error: <message>`` and exits 2; nothing else is printed, so the
    message itself must say what and where (a path, a line number, a field name).
    """

    def __init__(self, message: str):
        from evoharness.core.secrets import redact

        super().__init__(redact(" ".join(str(message).split())))  # never a credential in an error line


class EnvWorkerError(EvoError):
    """An environment worker crashed or hung; the episode it served is reported as errored."""


class PolicyError(EvoError):
    """The policy itself cannot act (unreachable endpoint, missing checkpoint): stops the batch,
    since every further episode would fail the same way. Finished episodes are already saved."""
