"""What every entry point checks before it talks to Prefect."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from evoharness.core.errors import EvoError


def prefect_api() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile (None: ephemeral mode)."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if url:
        return url
    from prefect.settings import PREFECT_API_URL

    return (PREFECT_API_URL.value() or "").strip() or None


def check_prefect(required: bool = False) -> str | None:
    """One line when the configured Prefect server cannot be reached (or, if required, when none
    is configured); ephemeral mode otherwise."""
    url = prefect_api()
    if url is None:
        if required:
            raise EvoError("no Prefect server is configured (PREFECT_API_URL): start one with `prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api")
        return None
    import base64

    # an API call, not /health: a server with an auth string (PREFECT_SERVER_API_AUTH_STRING) leaves /health open
    req = urllib.request.Request(url.rstrip("/") + "/admin/version")
    from prefect.settings import get_current_settings

    api = get_current_settings().api  # the environment or the active Prefect profile
    key, auth = (api.key.get_secret_value() if api.key else None), (api.auth_string.get_secret_value() if api.auth_string else None)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    elif auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            if r.status != 200:
                raise EvoError(f"Prefect server {url} answered {r.status} to an API call (PREFECT_API_URL)")
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise EvoError(f"Prefect server {url} refused this client ({e.code}): set PREFECT_API_AUTH_STRING (user:password) or PREFECT_API_KEY") from None
        raise EvoError(f"Prefect server {url} answered {e.code} to an API call (PREFECT_API_URL)") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EvoError(f"Prefect server {url} is unreachable ({reason}); start it (`prefect server start`) or unset PREFECT_API_URL to run in ephemeral mode") from None
    return url
