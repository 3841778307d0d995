"""The seeds' plugins, verbatim apart from their imports: one file a plugin, for ``--plugin-dir``."""
