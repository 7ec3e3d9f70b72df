"""Test helpers that ship with Plexus, so applications can test their own code without sockets."""

from .memory_network import MemoryNetwork, MemoryTransport
from .waiting import wait_until

__all__ = ["MemoryNetwork", "MemoryTransport", "wait_until"]
