"""What a person runs against a run's server, built on :class:`~rftstream.bus.client.Bus`.

Read-only inspection: :mod:`~rftstream.operations.account` (where every experience went,
``rftstream account``) and :mod:`~rftstream.operations.stream_view` (the streams and their
consumers, ``rftstream streams``; decoded messages, ``rftstream tail``). The bus below
knows nothing of them.
"""
