"""Small helpers shared by actors and user code, under Trinity-RFT's ``trinity.utils`` path.

``from rftstream.utils import Timer`` re-exports :class:`rftstream.utils.timer.Timer`
(Trinity-RFT's ``trinity.utils.timer.Timer``).
"""

from rftstream.utils.timer import Timer

__all__ = ["Timer"]
