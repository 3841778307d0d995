"""An in-memory :class:`~rftstream.bus.transport.Transport`, for unit tests of the logic above the bus.

What it keeps of JetStream's semantics (what the actors rely on):

* streams with subjects (``*`` and ``>`` wildcards), stream sequences from 1,
  deduplication by ``Nats-Msg-Id`` within the duplicate window, ``max_msgs`` /
  ``max_bytes`` / ``max_msg_size`` limits with ``discard: new`` (the publish
  raises :class:`~rftstream.errors.StreamFullError`) or ``discard: old`` (the
  oldest go), work-queue retention (an acked message leaves the stream), purges;
* durable pull consumers with a filter subject, delivery from the start or
  from a sequence, explicit acks, ``nak`` (with a delay), ``in_progress``,
  ``term``, redelivery once ``ack_wait`` passes (up to ``max_deliver``
  deliveries), ``max_ack_pending``, an ack floor and pending counts as
  ``consumer info`` shows them; replicas binding one durable share its messages;
* ordered reads and watches (ephemeral, nothing acked);
* KV buckets as streams ``KV_<bucket>`` with revisions (stream sequences),
  create / compare-and-set conflicts (:class:`~rftstream.errors.CasConflict`),
  delete markers and write notifications.

Not modelled: ``max_age``, replicas, interest retention (kept as limits),
headers counted toward ``max_payload`` on the server side (the
:class:`~rftstream.bus.client.Bus` checks them itself).

Everything runs on the caller's event loop (asyncio or trio): a publish wakes
waiting fetches and readers, and calls watch callbacks before it returns. Time
is ``clock`` (``time.monotonic`` by default): pass another to move ack waits
and nak delays forward without sleeping.
"""

from rftstream.bus.memory.streams import subject_matches
from rftstream.bus.memory.transport import MemoryTransport

__all__ = ["MemoryTransport", "subject_matches"]
