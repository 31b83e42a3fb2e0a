"""Structured logs: one JSON object per line on stderr.

Modules log with the standard library and pass their fields as `extra`:

    log.info("batch stored", extra={"events": 500, "dead_letters": 2})
    -> {"ts": "...", "level": "info", "logger": "rtrl.ingest", "msg": "batch stored", "events": 500, ...}

Every attribute `extra` put on the record reaches the line (the formatter takes whatever is not
a standard LogRecord attribute), so no call can lose its fields by using the other style: a
dict under `extra={"fields": {...}}` is spread into the line too. Field names must not clash
with LogRecord's own (`msg`, `args`, `module`, ...): logging raises KeyError for those.

Secrets handed to a library that may log them (the Kafka password: kafka-python's admin client
logs its whole configuration at debug) are registered with `mask` and replaced by `***` in every
line, whatever the level and whichever logger wrote it.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from urllib.parse import unquote, urlsplit, urlunsplit

# what every LogRecord has; anything else on a record came from `extra`
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
_SECRETS: set[str] = set()


def mask(secret: str) -> None:
    """Never write `secret` in a log line (as itself or as JSON escapes it)."""
    if len(secret) >= 4:  # a shorter one would mask ordinary words, and is no secret anyway
        _SECRETS.add(secret)
        _SECRETS.add(json.dumps(secret)[1:-1])


def mask_uri(uri: str) -> None:
    """Never write the password of `uri`'s userinfo (a store URL or tracking URI may hold one)
    in a log line or a command's error, as written or decoded."""
    password = urlsplit(uri).password
    if password:
        mask(password)
        mask(unquote(password))


def redacted_uri(uri: str) -> str:
    """A URI fit to print or store: without the password of its userinfo (a tracking URI such as
    https://user:token@mlflow.example or postgresql://rtrl:pw@db/mlflow holds one) and without
    its query string (tokens travel there too)."""
    parts = urlsplit(uri)
    if not parts.scheme or not parts.netloc:
        return uri.split("?", 1)[0]
    host = parts.netloc.rpartition("@")[2]
    user = parts.username
    netloc = f"{user}:***@{host}" if parts.password is not None else (f"{user}@{host}" if user else host)
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def scrub(line: str) -> str:
    """`line` with every registered secret replaced by `***`."""
    for secret in _SECRETS:
        line = line.replace(secret, "***")
    return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key in _STANDARD:
                continue
            if key == "fields" and isinstance(value, dict):
                out.update(value)
            else:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        line = json.dumps(out, default=str)
        return scrub(line) if _SECRETS else line


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # kafka-python, alembic and MLflow's store setup are chatty at INFO; their warnings still show
    for noisy in ("kafka", "alembic.runtime.migration", "mlflow.store.db.utils"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # kafka-python's event-loop timing warnings say nothing an operator can act on
    logging.getLogger("kafka.net.selector").setLevel(max(logging.ERROR, root.level))


def quiet_progress_bars() -> None:
    """No tqdm bars from transformers ("Loading weights") or MLflow ("Downloading artifacts") in
    a service's output: a daemon loads models every cycle, and its stderr is structured logs."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if "transformers" in sys.modules:  # already imported: its switch was read at import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
