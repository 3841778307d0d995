"""Secrets in the config: which keys hold them and how they are shown (never in clear).

``nats.token`` and ``nats.password`` are secrets, and so is a password or token
inside a NATS URL (``nats://user:pw@host``). Pure functions, no I/O.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

__all__ = ["SECRET_NATS_KEYS", "mask_value", "redact_url", "split_url_credentials"]

SECRET_NATS_KEYS = ("token", "password")  # keys of `nats` whose values are never shown
_SECRET_PATHS = tuple(f"nats.{k}" for k in SECRET_NATS_KEYS)
MASK = "***"


def redact_url(url: str) -> str:
    """``url`` with a password (``user:pw@``) or a token (``tok@``) replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, sep, _secret = userinfo.partition(":")
    shown = f"{user}:{MASK}" if sep else MASK
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{shown}@{host}"))


def split_url_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``url`` (one or several, comma-separated) without the credentials inside it, and
    those credentials as ``nats`` keys: ``{"user": ..., "password": ...}`` for
    ``user:pw@``, ``{"token": ...}`` for ``tok@`` (the first URL's, when several carry
    some). A URL without any comes back as it is, with ``{}``."""
    found: dict[str, str] = {}
    cleaned: list[str] = []
    for one in url.split(","):
        try:
            parts = urllib.parse.urlsplit(one.strip())
        except ValueError:
            cleaned.append(one)
            continue
        if "@" not in parts.netloc:
            cleaned.append(one.strip())
            continue
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, sep, secret = userinfo.partition(":")
        if not found:
            unquote = urllib.parse.unquote
            found = (
                {"user": unquote(user), "password": unquote(secret)}
                if sep
                else {"token": unquote(user)}
            )
        cleaned.append(urllib.parse.urlunsplit(parts._replace(netloc=host)))
    return ",".join(cleaned), found


def mask_value(path: str, value: Any) -> Any:
    """``value`` of the config key ``path`` as it may be shown: a secret as ``***``,
    a NATS URL (``nats.url``, ``nats.servers``) without its password."""
    if path in _SECRET_PATHS and value:
        return MASK
    if path == "nats.url" or path.startswith("nats.servers"):
        if isinstance(value, str):
            return redact_url(value)
        if isinstance(value, list):
            return [redact_url(v) if isinstance(v, str) else v for v in value]
    return value
