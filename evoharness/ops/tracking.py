"""MLflow owns decisions: where the tracking store is, and what a retrain logs.

The default store is ``sqlite:///<project>/mlflow.db`` with artifacts in ``<project>/mlartifacts``;
``MLFLOW_TRACKING_URI`` points anywhere else. Everything goes through an explicit
``MlflowClient`` (no global active run), so flows and their tasks can log from any thread.

What a retrain logs: one parent run, one child run per stage. Each run carries the git commit and
the DVC hashes of its stage's inputs and outputs as tags, the stage's metrics (flattened), and
the parent has ``dvc.lock`` and ``params.yaml`` as artifacts. Nothing from the environment is
logged, so no secret is.
"""

from __future__ import annotations

import json
import math
import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

from evoharness.core.errors import EvoError

EXPERIMENT = "evoharness-retrain"
DB_NAME = "mlflow.db"
ARTIFACTS = "mlartifacts"
CHECK_TIMEOUT_S = 30  # the preflight's wait for a tracking server's answer
# Keys that are never logged, whatever a params file or a metrics JSON holds.
SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "pwd", "auth", "credential", "signature")


def tracking_uri(root: Path | None = None) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    root = Path(root or Path.cwd()).resolve()
    return f"sqlite:///{root / DB_NAME}"


def check_tracking(uri: str) -> None:
    """One line naming the store when it cannot be used, before any run starts."""
    from evoharness.core.secrets import redact

    shown = redact(uri)
    if uri.startswith(("http://", "https://")):
        import base64
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(uri)
        try:
            port = parts.port
        except ValueError:
            raise EvoError(f"MLflow tracking URI {shown} has a port that is not a number (MLFLOW_TRACKING_URI)") from None
        bare = urlunsplit(parts._replace(netloc=(parts.hostname or "") + (f":{port}" if port else "")))
        # an API call, not /health: the server's auth (basic-auth app, a proxy) guards the API and leaves /health open
        req = urllib.request.Request(bare.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1")
        user, password = parts.username or os.environ.get("MLFLOW_TRACKING_USERNAME"), parts.password or os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if user:
            from urllib.parse import unquote

            req.add_header("Authorization", "Basic " + base64.b64encode(f"{unquote(user)}:{unquote(password or '')}".encode()).decode())
        elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
            req.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
        try:
            # a busy server's first answer may take seconds (MLflow's own client waits up to 120 s per request)
            with urllib.request.urlopen(req, timeout=CHECK_TIMEOUT_S) as r:
                if r.status != 200:
                    raise EvoError(f"MLflow tracking server {shown} answered {r.status} to an API call (MLFLOW_TRACKING_URI)")
        except urllib.error.HTTPError as e:
            raise EvoError(f"MLflow tracking server {shown} answered {e.code} to an API call (MLFLOW_TRACKING_URI; credentials: "
                           "MLFLOW_TRACKING_USERNAME/PASSWORD or TOKEN)") from None
        except (urllib.error.URLError, OSError) as e:
            reason = redact(str(getattr(e, "reason", e)))
            raise EvoError(f"MLflow tracking server {shown} is unreachable ({reason}); start it or unset MLFLOW_TRACKING_URI to use the project's sqlite store") from None
    elif uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise EvoError(f"MLflow sqlite store {uri}: folder {folder} does not exist or is not writable")
        db = Path(uri.removeprefix("sqlite:///"))
        if db.is_file() and db.stat().st_size:
            with open(db, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise EvoError(f"MLflow sqlite store {db} is not an SQLite database; move it aside (a fresh store is made) "
                                   "or restore it from a backup")
    elif uri.startswith("databricks"):
        return  # MLflow's own error names it
    elif "://" in uri:  # a database store: its driver must be installed (else a traceback deep in SQLAlchemy)
        try:
            from sqlalchemy.engine import make_url

            dialect = make_url(uri).get_dialect()
            dialect.import_dbapi() if hasattr(dialect, "import_dbapi") else dialect.dbapi()
        except Exception as e:
            why = f"module {e.name} is not installed" if isinstance(e, ImportError) and e.name else redact(str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise EvoError(f"MLflow tracking store {shown} cannot be used: {why} (MLFLOW_TRACKING_URI)") from None
    else:
        folder = Path(uri.removeprefix("file://"))
        if folder.exists() and not folder.is_dir():
            raise EvoError(f"MLflow file store {uri} is not a folder")


def client(root: Path | None = None):
    """A client on the project's store (checked first). MLflow's global URI is left alone:
    ``mlflow.set_tracking_uri`` also writes MLFLOW_TRACKING_URI into the environment, so a second
    project opened in the same process would silently log into the first one's store."""
    from mlflow import MlflowClient

    uri = client_uri(tracking_uri(root))
    return MlflowClient(tracking_uri=uri, registry_uri=uri if uri.startswith("sqlite:///") else None)


def client_uri(uri: str) -> str:
    """The URI MLflow's client is given, checked first: a server's userinfo (``http://user:password@host``) moves
    to MLFLOW_TRACKING_USERNAME / PASSWORD (which MLflow reads per request), since MLflow prints its tracking URI
    in links ("View run ... at") to stdout, which logs and Prefect keep."""
    check_tracking(uri)
    if not uri.startswith(("http://", "https://")):
        return uri
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parts.username or "")
    os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parts.password or "")
    return urlunsplit(parts._replace(netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else "")))


def experiment_id(c, root: Path | None = None, name: str = EXPERIMENT) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if c.tracking_uri.startswith("sqlite:///"):
        location = (Path(c.tracking_uri.removeprefix("sqlite:///")).parent / ARTIFACTS).as_uri()
    from mlflow.exceptions import MlflowException

    try:
        return c.create_experiment(name, artifact_location=location)
    except MlflowException as e:
        if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
        return c.get_experiment_by_name(name).experiment_id  # another retrain made it a moment ago


def _secret(key: str) -> bool:
    k = key.lower()
    return any(w in k for w in SECRET_WORDS)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(d, list) and all(not isinstance(x, (dict, list)) for x in d):
        out[prefix] = ",".join(str(x) for x in d)
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}.{i}"))
    else:
        out[prefix] = d
    from evoharness.core.secrets import redact

    # keys too: a key made from text (a policy spec, a URL) may carry what a value would
    return {redact(k): (redact(v) if isinstance(v, str) else v) for k, v in out.items() if not _secret(k)}


def numeric(d: dict) -> dict[str, float]:
    """The finite numbers of a flattened dict (MLflow metric names allow / . - _ and spaces)."""
    out = {}
    for k, v in flatten(d).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[re.sub(r"[^A-Za-z0-9_\-. /]", "_", k)] = float(v)  # the characters MLflow takes in a metric name
    return out


def log_metrics(c, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, v, now, step) for k, v in metrics.items()]
    for i in range(0, len(items), 500):
        c.log_batch(run_id, metrics=items[i : i + 500])


def log_params(c, run_id: str, params: dict) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i : i + 100])


def set_tags(c, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    from evoharness.core.secrets import redact

    items = [RunTag(k, redact(str(v))) for k, v in tags.items() if not _secret(k)]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, tags=items[i : i + 100])


def stage_hash_tags(stage: dict) -> dict[str, str]:
    """``dvc.dep.<path>`` / ``dvc.out.<path>`` → md5, from one stage's dvc.lock entry."""
    tags = {}
    for kind in ("deps", "outs"):
        for o in stage.get(kind, []) or []:
            if o.get("md5"):
                tags[f"dvc.{kind[:-1]}.{o['path']}"] = o["md5"]
    return tags


def curve_rows(path: Path) -> Iterable[dict]:
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def eval_metrics(results: dict) -> dict[str, float]:
    """The evaluate stage's per-model summaries → ``<model>.<split>.<family|all>.<field>``."""
    out: dict[str, float] = {}
    for label, splits in results.items():
        for split, s in splits.items():
            if not isinstance(s, dict):  # model_digest beside the splits
                continue
            for fam, v in s.items():
                if not isinstance(v, dict):
                    continue
                out[f"{label}.{split}.{fam}.success"] = float(v.get("success", 0.0))
                if fam == "all":
                    out[f"{label}.{split}.steps"] = float(v.get("steps", 0.0))
                    out[f"{label}.{split}.invalid_rate"] = float(v.get("invalid_rate", 0.0))
                    for verb, n in (v.get("calls") or {}).items():
                        out[f"{label}.{split}.calls.{verb}"] = float(n)
    return out
