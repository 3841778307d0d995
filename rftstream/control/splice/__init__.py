"""Splicing an operator in front of the trainer, and removing it again, while a run goes on.

``rftstream operator NAME --splice --to Y`` puts a new stage between the
stage ``X`` the trainer reads and the trainer; ``rftstream operator --unsplice
Y`` (or Ctrl-C / SIGTERM on the spliced operator) takes it out again. Neither
loses an experience or trains one twice. The protocol lives in the run's KV
bucket; every key is readable with ``nats kv get rft_<run>_state KEY``:

``splice`` (:data:`~rftstream.wire.SpliceRecord`)
    The one topology change in flight, one struct per ``state``. Writers move
    it on with compare-and-set, so two parties never both win.
``trainer.input`` (:class:`~rftstream.wire.TrainerInput`)
    The stage the trainer reads and the consumers it still drains (absent:
    ``train`` through the durable ``trainer``). Written by the trainer only.
``stage.<Y>`` (:class:`~rftstream.wire.StageRecord`)
    A spliced stage: its operator, durable and ``owner`` (the process serving
    it), which refreshes its ``ts`` every few seconds; a process that finds
    another owner there (it took a stale stage over) stops serving.
``topology`` (list of :class:`~rftstream.wire.TopologyEdge`)
    Every change so far.

Splice (``kind: "splice"``): the operator writes ``state: "requested"``; the
trainer claims it between two fetches, takes ``S``, the last stream sequence
its consumer delivered, creates its durable on ``exp.Y`` (from the stream's
next sequence) and answers ``"cut"`` with ``start_seq = S + 1``. The
operator's durable on ``exp.X`` starts there. Messages up to ``S`` stay the
trainer's: the old consumer is *retired* and drained up to ``S``, then deleted.

Unsplice (``kind: "unsplice"``), the exact inverse:

1. ``"asked"`` (only from ``--unsplice``): the owner of ``exp.Y`` sees it.
2. The owner stops fetching in every replica; each finishes and acks its
   batch. ``C`` = the last sequence its durable delivered. ``"requested"``.
3. The trainer claims it, creates a durable on ``exp.X`` from ``C + 1``, reads
   that from now on and retires its ``exp.Y`` consumer with an *open* cut (it
   takes everything there). ``"cut"``.
4. The owner drains: messages up to ``C`` that are still unacked (delivered to
   a crashed replica, lost in transit) are redelivered and processed; later
   ones, which the trainer now reads itself, are acked unprocessed. When its
   ack floor reaches ``C`` it takes ``D``, the last sequence on ``exp.Y``, and
   writes ``"drained"`` with ``drain_until = D``, deletes its durable and the
   ``stage.Y`` record.
5. The trainer drains ``exp.Y`` up to ``D``, deletes that consumer: ``"done"``.

A spliced operator that dies (SIGKILL) is restarted with the same ``--splice``
command: it finds ``stage.Y`` and resumes its durable (or an unsplice that was
under way) instead of splicing again. While it is down, the trainer writes
``trainer.waiting`` with the command to run, which ``rftstream status`` shows.

Modules: :mod:`rftstream.control.splice.protocol` holds the transitions and decisions
(pure, time passed in); :mod:`rftstream.control.splice.operator_side` the KV loops of
the operator, ``--unsplice`` and the stage's owner;
:mod:`rftstream.actors.topology` the trainer's, :mod:`rftstream.actors.spliced`
the spliced operator process.
"""
