"""The ``megamoe`` command: ``main`` parses (without importing torch), ``commands`` runs.

``main.main`` is the console script; it builds the parser, then imports ``commands``, which
dispatches to ``demo``, ``sample``, ``inspection``, ``verify``, ``bench`` and
``megamoe.core.convert``. ``exit_codes`` holds the codes both sides return. The top of
``megamoe.core``: nothing else in the package imports it.
"""
