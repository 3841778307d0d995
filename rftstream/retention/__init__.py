"""What the run's streams keep, and for how long: limits, back-pressure, purging acked experience.

Above the transport (:mod:`rftstream.bus`), below the actors:

* :mod:`~rftstream.retention.limits`: purge points and the purge itself
  (:func:`purge_acked`), the :class:`~rftstream.bus.client.Bus` hook that purges when a
  publish finds the experience stream full (:func:`purge_on_full`), and the explorer's
  back-pressure (:class:`ExperienceRoom`);
* :mod:`~rftstream.retention.purged`: the ledger of purged experience (``purged.<stage>``),
  which the run's account reads;
* :mod:`~rftstream.retention.reader_history`: who read each stage, sequence by sequence,
  across splices (pure).
"""

from rftstream.retention.limits import ExperienceRoom, purge_acked, purge_on_full

__all__ = ["ExperienceRoom", "purge_acked", "purge_on_full"]
