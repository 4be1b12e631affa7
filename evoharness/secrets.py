"""Credentials never leave the process that was given them: ``redact`` strips them from any text
that reaches a message, a log line, a Prefect parameter, an MLflow tag or a fingerprint."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
_QUERY = re.compile(r"([?&](?:token|key|secret|password|passwd|sig|signature|access_token|api_key)=)[^&\s]*", re.I)


def redact(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://host``, and secret-looking query values -> ``***``."""
    return _QUERY.sub(r"\1***", _USERINFO.sub(r"\1", str(text)))
