"""Subcommands of the ``elasticlab`` CLI, one module each (see elasticlab/__main__.py)."""
