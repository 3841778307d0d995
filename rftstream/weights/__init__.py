"""Moving the policy's weights from the trainer to explorers (``synchronizer.sync_method``).

* ``jetstream`` (the default): versions on the run's weights stream, encoded as
  keyframes and byte deltas in the engine's dtype (:mod:`rftstream.weights.codec`),
  published in the background by the trainer (:mod:`rftstream.weights.publisher`),
  fetched and staged in the background by each explorer and swapped in between
  requests (:mod:`rftstream.weights.fetcher`). Nothing shared but NATS.
* ``checkpoint`` and ``memory``: files on a shared path, or one process's memory
  (:mod:`rftstream.weights.files`).
"""

from rftstream.errors import WeightSyncError
from rftstream.weights.files import (
    MEMORY_STORE,
    checkpoint_dir,
    load_weights,
    save_weights,
    snapshot,
    weights_file_name,
)

__all__ = [
    "MEMORY_STORE",
    "WeightSyncError",
    "checkpoint_dir",
    "load_weights",
    "save_weights",
    "snapshot",
    "weights_file_name",
]
