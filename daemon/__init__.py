"""The node daemon, ``ckptstaged``: a package per stage of a checkpoint's way, over the foundation beside them.

Stages, lowest first (each imports only its own and those below: ``tests/test_layers.py``): ``tiers``,
``catalog``, ``save`` and ``drain``, ``retention``, ``node``, ``serve``. The foundation (errors, logs, journald,
events, metrics, fsutil, tierpath, config, configvalues) sits under all of them; ``main`` on top. See
docs/ARCHITECTURE.md.
"""
