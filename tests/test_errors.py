"""The error roots: who is at fault, and what a caller can catch."""

import plexus
from plexus.errors import PeerError, PeerMisbehaved, PhaseTimeout, PlexusError, RankFailed, UsageError


def test_errors_say_who_is_at_fault_and_are_catchable_from_plexus():
    assert issubclass(UsageError, ValueError) and issubclass(PhaseTimeout, TimeoutError)
    for error in (UsageError, PeerError, PeerMisbehaved, PhaseTimeout, RankFailed):
        assert issubclass(error, PlexusError) and getattr(plexus, error.__name__) is error
    error = PeerMisbehaved("sent a NaN", peer="12D3KooW", protocol="all-reduce", phase="part 3")
    assert str(error) == "sent a NaN (peer 12D3KooW, protocol all-reduce, phase part 3)"
    assert str(PeerError("went away")) == "went away" and PhaseTimeout("late", phase="dial").phase == "dial"
    assert RankFailed("rank 1 died", rank=1, phase="step").rank == 1


# Signals that steer control flow inside one module, never reaching a caller.
NOT_ERRORS = {"NeedMoreData", "Terminated"}


def public_exception_classes():
    """Every exception class that a plexus module defines under a public name."""
    import importlib
    import inspect
    import pkgutil

    found = {}
    for module_info in pkgutil.walk_packages(plexus.__path__, "plexus."):
        if module_info.name.startswith(("plexus.compat.", "plexus.dashboard")) or module_info.name.endswith(
            "__main__"
        ):
            continue  # compat mirrors hivemind's classes; optional extras may be missing
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
                and name not in NOT_ERRORS
            ):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_public_exception_has_a_plexus_root():
    classes = public_exception_classes()
    assert len(classes) > 40
    rootless = sorted(name for name, cls in classes.items() if not issubclass(cls, PlexusError))
    assert rootless == [], f"not under PlexusError: {rootless}"


def test_errors_a_caller_meets_are_exported_and_keep_their_standard_bases():
    assert issubclass(plexus.DialError, (PeerError, ConnectionError))
    assert issubclass(plexus.StateDownloadTimeout, PhaseTimeout) and issubclass(
        plexus.StateDownloadTimeout, plexus.StateDownloadError
    )
    assert issubclass(plexus.MultiaddrError, ValueError) and issubclass(plexus.CompressionError, ValueError)
    from plexus.p2p.protocols.errors import RemoteProtocolError
    from plexus.utils.serializer import SerializationError

    assert issubclass(RemoteProtocolError, PeerMisbehaved) and issubclass(SerializationError, PeerMisbehaved)
    error = plexus.RPCError("the handler's text", peer="12D3KooW", protocol="/x/1.0.0")
    assert str(error) == "the handler's text" and error.peer == "12D3KooW"
    for name in plexus.__all__:
        value = getattr(plexus, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, PlexusError), name
