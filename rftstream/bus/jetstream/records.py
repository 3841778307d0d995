"""JetStream's API records as the transport's neutral ones (:mod:`rftstream.bus.transport`)."""

from __future__ import annotations

from nats.js import api

from rftstream.bus.transport import ConsumerSpec, ConsumerState, StreamSpec, StreamState

_RETENTION = {
    "limits": api.RetentionPolicy.LIMITS,
    "work_queue": api.RetentionPolicy.WORK_QUEUE,
    "interest": api.RetentionPolicy.INTEREST,
}


def consumer_state(info: api.ConsumerInfo) -> ConsumerState:
    """A ``ConsumerInfo`` as a :class:`ConsumerState`."""
    cfg = info.config
    return ConsumerState(
        name=str(info.name),
        durable=bool(getattr(cfg, "durable_name", None)),
        filter_subject=str(getattr(cfg, "filter_subject", None) or ""),
        description=str(getattr(cfg, "description", None) or ""),
        metadata=dict(getattr(cfg, "metadata", None) or {}),
        delivered=int(getattr(info.delivered, "stream_seq", 0) or 0),
        ack_floor=int(getattr(info.ack_floor, "stream_seq", 0) or 0),
        num_pending=int(info.num_pending or 0),
        num_ack_pending=int(info.num_ack_pending or 0),
        num_redelivered=int(info.num_redelivered or 0),
    )


def stream_state(info: api.StreamInfo) -> StreamState:
    """A ``StreamInfo`` as a :class:`StreamState`."""
    st = info.state
    return StreamState(
        first_seq=int(st.first_seq or 0),
        last_seq=int(st.last_seq or 0),
        messages=int(st.messages or 0),
        bytes=int(st.bytes or 0),
        consumer_count=int(st.consumer_count or 0),
        subjects=dict(st.subjects or {}),
        description=str(getattr(info.config, "description", None) or ""),
    )


def stream_config(spec: StreamSpec) -> api.StreamConfig:
    """A :class:`StreamSpec` as the ``StreamConfig`` to create or update."""
    return api.StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        metadata=dict(spec.metadata),
        storage=api.StorageType.MEMORY if spec.storage == "memory" else api.StorageType.FILE,
        num_replicas=spec.num_replicas,
        max_msg_size=spec.max_msg_size,
        duplicate_window=spec.duplicate_window,
        max_bytes=spec.max_bytes,
        max_msgs=spec.max_msgs,
        max_age=spec.max_age,
        discard=api.DiscardPolicy.OLD if spec.discard == "old" else api.DiscardPolicy.NEW,
        allow_direct=spec.allow_direct or None,
    )


def consumer_config(spec: ConsumerSpec) -> api.ConsumerConfig:
    """A :class:`ConsumerSpec` as a durable pull ``ConsumerConfig`` with explicit acks."""
    return api.ConsumerConfig(
        durable_name=spec.durable,
        description=spec.description,
        deliver_policy=api.DeliverPolicy.ALL
        if spec.start_seq is None
        else api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=spec.start_seq,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait,
        max_deliver=spec.max_deliver,
        filter_subject=spec.filter_subject,
        max_ack_pending=spec.max_ack_pending,
        metadata=dict(spec.metadata),
    )
