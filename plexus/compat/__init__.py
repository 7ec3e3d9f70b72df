"""Run code written for hivemind on Plexus without editing it.

Two ways in, both opt-in:

    import plexus.compat
    plexus.compat.install()        # from here on, `import hivemind` gives Plexus
    import hivemind

    python -m plexus.compat train.py --its --flags      # the same, for a script left untouched
    python -m plexus.compat -m package.module --flags

The hook (`hook.py`) maps hivemind's module paths onto Plexus's; this package also keeps the
hivemind-only spellings in one place: the older collaborative API of the DeDLOC/sahajBERT era
(`CollaborativeOptimizer`, `CollaborationState`, `DecentralizedSGD`, ...), renamed helpers
(`use_hivemind_log_handler`), `CompressionType` under `hivemind.proto.runtime_pb2`, and the
`hivemind-dht`/`hivemind-server` command lines. docs/coming-from-hivemind.md lists every public
name of hivemind 1.1.12 and what Plexus offers for it.
"""

from .hook import install, installed, uninstall

__all__ = ["install", "installed", "uninstall"]
