"""A config as plain data with its secrets hidden: what monitors and reports record.

:func:`masked_config` turns a :class:`~rftstream.config.schema.Config` into nested
dicts and lists (msgspec builtins) and replaces the value of every secret key
(``api_key``, ``password``, ``token``, ``secret`` and names ending in them) and the
password of any URL (``nats://user:pw@host``) by :data:`MASK`. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = ["MASK", "is_secret_key", "masked_config", "masked_data"]

MASK = "***"
_SECRET_KEY = re.compile(
    r"(^|_)(api_?key|password|passwd|secret|token|access_key|secret_key|auth)$", re.IGNORECASE
)
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]+:)(?P<pw>[^@\s/]+)(?=@)", re.I)


def is_secret_key(key: str) -> bool:
    """Whether a config key names a secret (``api_key``, ``hf_token``, ``password``...).

    Counts such as ``max_tokens`` are not secrets: only a final ``token`` is."""
    return bool(_SECRET_KEY.search(key))


def masked_data(data: Any) -> Any:
    """A copy of nested dicts/lists/scalars with secret keys' values and URL passwords
    replaced by :data:`MASK` (empty and ``None`` values stay as they are)."""
    if isinstance(data, dict):
        return {
            k: (MASK if is_secret_key(str(k)) and v not in (None, "") else masked_data(v))
            for k, v in data.items()
        }
    if isinstance(data, (list, tuple)):
        return [masked_data(v) for v in data]
    if isinstance(data, str):
        return _URL_PASSWORD.sub(lambda m: m.group("head") + MASK, data)
    return data


def masked_config(cfg: Any) -> dict[str, Any]:
    """``cfg`` (a Config or any msgspec struct) as nested builtins, secrets masked."""
    return masked_data(msgspec.to_builtins(cfg))
