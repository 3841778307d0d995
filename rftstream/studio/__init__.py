"""``rftstream studio``: a config generator page and a live view of a run (aiohttp + plain HTML).

:mod:`rftstream.studio.forms` turns the config schema into form fields and form values
into a validated YAML config (:mod:`rftstream.studio.doctext` its docstrings into text
and code); :mod:`rftstream.studio.launcher` runs ``rftstream up`` on it (the Run and
Stop buttons); :mod:`rftstream.studio.live` reads a run from NATS;
:mod:`rftstream.studio.server` serves both pages and their JSON API.
"""
