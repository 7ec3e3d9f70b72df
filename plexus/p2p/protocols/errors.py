"""Errors of the protocol cores, split by who is at fault.

Strategy (after h11): inside a core, anything illegal raises LocalProtocolError or
RemoteProtocolError directly. The entry point for peer bytes (`receive_data`) only ever lets
RemoteProtocolError out: the driver closes that one connection, logs the reason, and keeps serving
everyone else. LocalProtocolError means our own code asked for something illegal (a bug).
After either, the core is in a terminal state and every later call fails fast.
"""

from ...errors import PeerMisbehaved, PlexusError


class ProtocolError(PlexusError):
    """Base of every protocol-core error."""


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol (or the core's state) does not allow."""


class RemoteProtocolError(ProtocolError, PeerMisbehaved):
    """The peer sent something malformed, oversized or out of order."""
