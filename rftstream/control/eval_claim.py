"""Eval claims: exactly one explorer evaluates each step.

An explorer that reaches an evaluation point (``explorer.eval_interval``) creates the KV
record ``eval.step.<n>`` (``eval.final`` after training; ``bench.step.<n>`` in mode
``bench``), an :class:`~rftstream.wire.EvalClaim`, only if it is absent: the one whose
create succeeds evaluates, the others go on. One that fails or is cancelled before its
metrics and record are out releases the claim (deletes the key), so a later explorer
evaluates that step instead of skipping it. A create is one KV round trip; nothing here
waits.
"""

from __future__ import annotations

import logging

import anyio

from rftstream.bus.state import RunState
from rftstream.wire import EVAL_FINAL, EVAL_STEP, EvalClaim, Key

log = logging.getLogger(__name__)

#: how long releasing a claim may take before it is given up (the connection may be gone)
RELEASE_S = 5.0


def eval_claim_key(step: int, *, final: bool, claim_key: str | None = None) -> Key[EvalClaim]:
    """The record claimed for an evaluation after ``step``: ``claim_key`` where given,
    else ``eval.final`` or ``eval.step.<step>``."""
    if claim_key:
        return Key(claim_key, EvalClaim)
    return EVAL_FINAL if final else EVAL_STEP.of(step=str(step))


async def claim_eval(state: RunState, key: Key[EvalClaim], claim: EvalClaim) -> bool:
    """Create ``key`` with ``claim`` if absent. True: this actor evaluates; False: another
    claimed it first. Raises a :class:`~rftstream.errors.BusError` on a KV failure."""
    return await state.create(key, claim)


async def release_eval(state: RunState, key: Key[EvalClaim], by: str) -> None:
    """Delete a claim whose evaluation did not finish, so another explorer takes the step.
    Shielded from cancellation, bounded by :data:`RELEASE_S`; a failure is logged
    (naming ``by`` and the key), never raised: it runs while an error is on its way out."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_S):
        try:
            await state.delete(key)
        except Exception as exc:  # noqa: BLE001 - the connection may be gone
            log.warning("%s: could not release the claim %s: %s", by, key.name, exc)
