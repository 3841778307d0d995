"""Trinity-RFT's ``trinity.buffer`` names: ``from rftstream.buffer import get_buffer_reader``.

The readers a sample strategy opens live in :mod:`rftstream.buffer.readers`
(see there for what they read, and when they block); this package re-exports
its public names under the path Trinity-RFT plugins import.
"""

from rftstream.buffer.readers import BufferReader, get_buffer_reader

__all__ = ["BufferReader", "get_buffer_reader"]
