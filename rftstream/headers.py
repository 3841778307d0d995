"""The headers of an experience message, torch-free (the bus reads them without decoding).

Summary headers make ``nats stream view`` readable without decoding the body; ``Nats-Msg-Id``
is JetStream's deduplication id.
"""

from __future__ import annotations

import itertools

__all__ = [
    "H_ACTOR",
    "H_COUNT",
    "H_MODEL_VERSION",
    "H_MSG_ID",
    "H_PART",
    "H_REWARD_MEAN",
    "H_SCHEMA",
    "H_TASK",
    "H_TOKENS",
    "headers_size",
]

H_SCHEMA = "Rft-Schema"
H_TASK = "Rft-Task"
H_MODEL_VERSION = "Rft-Model-Version"
H_COUNT = "Rft-Count"
H_REWARD_MEAN = "Rft-Reward-Mean"
H_TOKENS = "Rft-Tokens"
H_ACTOR = "Rft-Actor"
H_PART = "Rft-Part"
H_MSG_ID = "Nats-Msg-Id"


def headers_size(headers: dict[str, str]) -> int:
    """Bytes the headers take on the wire (``NATS/1.0\\r\\n`` + ``k: v\\r\\n``... + ``\\r\\n``)."""
    text = "".join(itertools.chain.from_iterable(headers.items()))
    n = len(text) if text.isascii() else len(text.encode())
    return 12 + n + 4 * len(headers) + 2
