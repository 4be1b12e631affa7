"""What every entry point checks before it talks to Prefect."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from evoharness.errors import EvoError


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
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as r:
            if r.status != 200:
                raise EvoError(f"Prefect server {url} answered {r.status} on /health (PREFECT_API_URL)")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EvoError(f"Prefect server {url} is unreachable ({reason}); start it (`prefect server start`) or unset PREFECT_API_URL to run in ephemeral mode") from None
    return url
