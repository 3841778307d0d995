"""What a person sees: the terminal (:mod:`~rftstream.presentation.console`, the step
lines), the metrics plot and the HTML report of a run, and readable summaries of bus
messages for ``status``, ``tail`` and the studio. Nothing here runs an actor."""
