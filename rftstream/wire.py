"""Every control record on the bus, as typed msgspec structs, with typed KV key handles.

The data plane's records (experiences, tasks, metrics, dead letters) are in
:mod:`rftstream.experience` and :mod:`rftstream.messages`; this module holds
the control plane: what actors write to the run's KV bucket
(``rft_<run>_state``) and read back. Every record is JSON (readable with
``nats kv get``), decoded into its struct, so a drifted shape is an error at
the reader instead of a ``KeyError`` somewhere later.
"""

from __future__ import annotations

# --- splice protocol: splice, trainer.input, stage.<Y>, topology, trainer.waiting/started/done (H-splice)

# --- explorer side: taskset claim, heartbeat, trainer.starving (H-explorer)
