"""How the core finds plugins: the :class:`~rftstream.plugins.registry.Registry` type,
the registries config names are looked up in (:mod:`rftstream.plugins.registries`) and
the loading of plugin files and entry points (:mod:`rftstream.plugins.loader`).

The plugin packages (``operators``, ``algorithms``, ``workflows``) and users' plugins
import these registries and register into them; the core never imports a plugin.
"""
