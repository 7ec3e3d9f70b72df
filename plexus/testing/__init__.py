"""Test helpers that ship with Plexus, so applications can test their own code.

- `MemoryNetwork`: DHT transports in memory (many nodes, one event loop, no sockets);
- `wait_until`: poll a condition under a deadline instead of sleeping;
- `LocalSwarm`: `plexus.Optimizer` peers in local processes, with churn (`ChurnSchedule`) and faulty
  members (`Fault` and its kinds), and a `SwarmReport` of what happened. `python -m
  plexus.testing.churn --help` runs one from the command line.
"""

from .faults import FAULT_KINDS, Fault, ForgedProgress, NaNGradients, ScaledGradients, Silent, Slow
from .memory_network import MemoryNetwork, MemoryTransport
from .report import SwarmReport
from .swarm import DEFAULT_OPTIMIZER_OPTIONS, ChurnEvent, ChurnSchedule, LocalSwarm
from .tasks import RegressionTask, flat_parameters
from .waiting import wait_until

__all__ = [
    "DEFAULT_OPTIMIZER_OPTIONS",
    "FAULT_KINDS",
    "ChurnEvent",
    "ChurnSchedule",
    "Fault",
    "ForgedProgress",
    "LocalSwarm",
    "MemoryNetwork",
    "MemoryTransport",
    "NaNGradients",
    "RegressionTask",
    "ScaledGradients",
    "Silent",
    "Slow",
    "SwarmReport",
    "flat_parameters",
    "wait_until",
]
