"""rftstream: reinforcement fine-tuning of LLMs as an async actor system over NATS JetStream."""

from rftstream.errors import RftError
from rftstream.experience import EID, Experience, group_by
from rftstream.registry import Registry

__all__ = ["EID", "Experience", "Registry", "RftError", "group_by"]
__version__ = "0.1.0"
