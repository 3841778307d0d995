"""Launching a run: ``rftstream up`` and the processes it starts and watches.

* :mod:`~rftstream.launch.up`: ``up``, the embedded server, the actors in child processes
  or in this one, the summary at the end;
* :mod:`~rftstream.launch.up_stages`: a Trinity-RFT multi-stage config, one run stage after
  the other;
* :mod:`~rftstream.launch.actor_process`: one child process running actors
  (``python -m rftstream.launch.actor_process``);
* :mod:`~rftstream.launch.prestart`: children started while the run is prepared, handed
  their command line when it is ready;
* :mod:`~rftstream.launch.supervise`: restarting a child that died, within its budget.

Nothing here is imported by the actors or the runtime: this package is the top of the
house, below only :mod:`rftstream.cli`.
"""
