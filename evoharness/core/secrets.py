"""Credentials never leave the process that was given them: ``redact`` strips them from any text
that reaches a message, a log line, a Prefect parameter, an MLflow tag or a fingerprint, and
``public_url`` gives the form of a URL another machine may be handed (its user kept, its secret gone).

A URL's user is not a secret (``ssh://git@host/repo.git`` logs in as ``git``; stripping it makes the
other machine log in as its own user, which the forge refuses); its password is, and so is a user
name that is itself a token (``https://ghp_...@github.com``)."""

from __future__ import annotations

import re

# The userinfo of a URL: everything up to the last '@' before the host's path (a password may hold a raw '@').
_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)([^/\s]+)@(?=[^@/\s]*(?:[/\s?#]|$))", re.I)
_QUERY = re.compile(r"([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|token|key|apikey|api[_-]?key|secret|client_secret|"
                    r"password|passwd|pwd|auth|sig|signature|access_token|access_key|aws_secret_access_key|session_token)=)[^&\s]*", re.I)
# A credential in free text: an Authorization header's value, or NAME=VALUE / NAME: VALUE of a secret-named setting.
_HEADER = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}")
_ASSIGN = re.compile(r"\b((?:aws_secret_access_key|aws_session_token|secret_access_key|client_secret|api[_-]?key|apikey|access_key|"
                     r"password|passwd|pwd|secret|token)\s*[=:]\s*)(?!\*\*\*)[^\s,;&'\"]+", re.I)
_TOKEN_USER = re.compile(r"^(?:gh[opsur]_|github_pat_|glpat-|x-access-token|[A-Za-z0-9_\-]{32,}$)")


def _userinfo(m: re.Match, secret: str | None) -> str:
    user, sep, _password = m.group(2).partition(":")
    if _TOKEN_USER.match(user):
        return m.group(1) if secret is None else f"{m.group(1)}{secret}@"
    if not sep:
        return f"{m.group(1)}{user}@"
    return f"{m.group(1)}{user}@" if secret is None else f"{m.group(1)}{user}:{secret}@"


def redact(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host`` (a token as the user: ``***@host``),
    and secret-looking query values -> ``***``."""
    text = _QUERY.sub(r"\1***", _USERINFO.sub(lambda m: _userinfo(m, "***"), str(text)))
    return _ASSIGN.sub(r"\1***", _HEADER.sub(r"\1 ***", text))


def public_url(url: str) -> str:
    """The URL without its secret, for another machine that brings its own credential for it:
    ``https://user:token@host/x`` -> ``https://user@host/x``; ``ssh://git@host/x`` stays as it is."""
    return _QUERY.sub(r"\1***", _USERINFO.sub(lambda m: _userinfo(m, None), str(url)))
