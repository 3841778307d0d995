"""rftstream: reinforcement fine-tuning of LLMs as an async actor system over NATS JetStream.

The names below are imported on first use (``rftstream.Experience`` imports torch):
``rftstream up`` starts its child processes before the parent pays for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rftstream.errors import RftError
    from rftstream.experience import EID, Experience, group_by
    from rftstream.plugins.registry import Registry

__all__ = ["EID", "Experience", "Registry", "RftError", "group_by"]
__version__ = "0.1.0"

_HOMES = {
    "EID": "rftstream.experience",
    "Experience": "rftstream.experience",
    "group_by": "rftstream.experience",
    "Registry": "rftstream.plugins.registry",
    "RftError": "rftstream.errors",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rftstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
