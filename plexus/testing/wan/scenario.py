"""Scenarios: a lab of profiled peers from a small TOML file (or a dict), measured and put to work.

    mtu = 1500                  # optional, like every section but [peers]
    seed = 1
    congestion_control = "cubic"

    [profiles.fiber]            # profiles of your own: every field, or a named `base` plus changes
    base = "home"
    down = "1gbit"
    up = "500mbit"

    [peers]                     # name = profile, or a table: profile, count (home1, home2, ...), changes
    server = "datacenter"
    home = { profile = "home", count = 2 }
    laptop = { profile = "notebook", loss = "1%" }

    [measure]                   # plain TCP/UDP on pairs of peers, next to the configured figures
    pairs = "star"              # "star": the first peer and each other; "all"; or [["server", "laptop"]]
    rtt_count = 20
    udp_count = 2000
    tcp_seconds = 3

    [[run]]                     # your programs, one per listed peer (group names stand for each member)
    peers = ["server", "home"]
    command = ["python", "my_peer.py"]
    timeout = 300

Programs run inside their peer's namespace with PLEXUS_LAB_PEER (its name), PLEXUS_LAB_ADDRESS (the
address to listen on), PLEXUS_LAB_PEERS (JSON: every peer's name -> address others can reach, null
for peers behind NATs) and PLEXUS_LAB_DIR (a directory all of them share, removed afterwards, e.g.
for the first peer to leave its multiaddr in) in their environment, in the order of the [[run]]
tables. A scenario
with neither [measure] nor [[run]] measures the star. Link fields: down, up ("100mbit"), rtt,
jitter, queue ("30ms"), loss ("0.5%"), nat (true/false).
"""

import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Mapping

from ...errors import UsageError
from .lab import LabOptions, resolve_profile
from .measure import MeasureOptions
from .profiles import LinkProfile, profile_from_fields

OUTPUT_TAIL_LINES = 5  # of each program's output, kept for the report
LAB_KEYS = ("mtu", "seed", "tick", "congestion_control")  # top-level keys that are LabOptions


@dataclasses.dataclass
class Program:
    peers: list[str]
    command: list[str]
    timeout: float = 300.0


@dataclasses.dataclass
class Scenario:
    peers: dict[str, LinkProfile]
    lab: LabOptions = dataclasses.field(default_factory=LabOptions)
    pairs: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    measure: MeasureOptions = dataclasses.field(default_factory=MeasureOptions)
    programs: list[Program] = dataclasses.field(default_factory=list)


def load_scenario(path: str) -> Scenario:
    """Read a scenario file (TOML; see the module docstring)."""
    try:
        with open(path, "rb") as file:
            config = tomllib.load(file)
    except OSError as error:
        raise UsageError(f"cannot read scenario {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"scenario {path} is not valid TOML: {error}") from None
    return scenario_from_config(config, where=path)


def scenario_from_config(config: Mapping, where: str = "scenario") -> Scenario:
    """A scenario from the parsed config (the same structure as the TOML file)."""
    _check_keys(config, {*LAB_KEYS, "profiles", "peers", "measure", "run"}, where)
    profiles = _profiles(config.get("profiles", {}), where)
    peers, groups = _peers(config.get("peers"), profiles, where)
    lab_fields = {key: config[key] for key in LAB_KEYS if key in config}
    scenario = Scenario(peers, LabOptions(**lab_fields))
    measure = dict(config.get("measure", {}))
    measure_keys = {"pairs"} | {field.name for field in dataclasses.fields(MeasureOptions)}
    _check_keys(measure, measure_keys, f"{where} [measure]")
    pairs = measure.pop("pairs", "star" if "measure" in config or "run" not in config else [])
    scenario.measure = MeasureOptions(**measure)
    scenario.pairs = _pairs(pairs, peers, groups, where)
    for index, program in enumerate(config.get("run", [])):
        scenario.programs.append(_program(program, peers, groups, f"{where} [[run]] #{index + 1}"))
    return scenario


def _check_keys(table: Mapping, allowed: set, where: str) -> None:
    if not isinstance(table, Mapping):
        raise UsageError(f"{where}: expected a table, got {table!r}")
    unknown = set(table) - allowed
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {sorted(unknown)}; expected some of {sorted(allowed)}")


def _profiles(table: Mapping, where: str) -> dict[str, LinkProfile]:
    if not isinstance(table, Mapping):
        raise UsageError(f"{where} [profiles]: expected tables of link fields, got {table!r}")
    profiles: dict[str, LinkProfile] = {}
    for name, fields in table.items():
        fields = dict(fields)
        base = fields.pop("base", None)
        base_profile = (profiles.get(base) or resolve_profile(base)) if base else None
        profiles[name] = profile_from_fields(fields, base_profile, f"{where} [profiles.{name}]")
    return profiles


def _peers(table, profiles: dict[str, LinkProfile], where: str):
    if not table:
        raise UsageError(f'{where}: a scenario needs a [peers] table, e.g. a = "home"')
    peers: dict[str, LinkProfile] = {}
    groups: dict[str, list[str]] = {}
    for name, spec in table.items():
        if isinstance(spec, str):
            spec = {"profile": spec}
        spec = dict(spec)
        profile_name, count = spec.pop("profile", None), spec.pop("count", 1)
        if profile_name is None:
            raise UsageError(f'{where} [peers] {name}: say which profile, e.g. {{ profile = "home" }}')
        profile = profiles.get(profile_name) or resolve_profile(profile_name)
        if spec:
            profile = profile_from_fields(spec, profile, f"{where} [peers] {name}")
        if not isinstance(count, int) or count < 1:
            raise UsageError(f"{where} [peers] {name}: count must be a positive integer, got {count!r}")
        members = [name] if count == 1 else [f"{name}{i}" for i in range(1, count + 1)]
        for member in members:
            if member in peers:
                raise UsageError(f"{where} [peers]: the name {member!r} is used twice")
            peers[member] = profile
        groups[name] = members
    return peers, groups


def _members(name: str, peers: Mapping, groups: Mapping, where: str) -> list[str]:
    if name in groups:
        return groups[name]
    if name in peers:
        return [name]
    raise UsageError(f"{where}: no peer or group {name!r}; there are {sorted(set(peers) | set(groups))}")


def _pairs(spec, peers: Mapping[str, LinkProfile], groups, where: str) -> list[tuple[str, str]]:
    names = list(peers)
    if spec == "star":
        candidates = [(names[0], other) for other in names[1:]]
    elif spec == "all":
        candidates = [(a, b) for a in names for b in names if a != b]
    elif isinstance(spec, list):
        candidates = []
        for pair in spec:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise UsageError(f"{where} [measure] pairs: each pair is [from, to], got {pair!r}")
            for a in _members(pair[0], peers, groups, where):
                candidates += [(a, b) for b in _members(pair[1], peers, groups, where) if b != a]
    else:
        raise UsageError(f'{where} [measure] pairs: "star", "all" or a list of [from, to], got {spec!r}')
    return [(a, b) for a, b in candidates if not (peers[a].nat and peers[b].nat)]


def _program(table, peers, groups, where: str) -> Program:
    _check_keys(table, {"peers", "command", "timeout"}, where)
    command = table.get("command")
    if isinstance(command, str):
        command = command.split()
    if not command or not all(isinstance(part, str) for part in command):
        raise UsageError(f'{where}: `command` must be a list of strings, e.g. ["python", "peer.py"]')
    members = [m for name in table.get("peers", list(groups)) for m in _members(name, peers, groups, where)]
    return Program(members, list(command), float(table.get("timeout", 300.0)))


# --- running programs -----------------------------------------------------------------------------


@dataclasses.dataclass
class ProgramResult:
    peer: str
    command: list[str]
    returncode: int | None
    """None: still running at its timeout (then killed)."""
    seconds: float
    output_tail: str


def run_programs(lab, programs: list[Program]) -> list[ProgramResult]:
    """Start every program in its peer's namespace, wait for all, and collect how each ended."""
    with tempfile.TemporaryDirectory(prefix="plexus-lab-") as shared:
        return _run_programs(lab, programs, shared)


def _run_programs(lab, programs: list[Program], shared: str) -> list[ProgramResult]:
    directory = {name: (None if profile.nat else lab.address(name)) for name, profile in lab.profiles.items()}
    running = []
    for program in programs:
        for peer in program.peers:
            env = dict(
                os.environ,
                PLEXUS_LAB_PEER=peer,
                PLEXUS_LAB_ADDRESS=lab.address(peer),
                PLEXUS_LAB_PEERS=json.dumps(directory),
                PLEXUS_LAB_DIR=shared,
                PYTHONUNBUFFERED="1",
            )
            process = lab.spawn(peer, _resolve_python(program.command), env=env, stderr=subprocess.STDOUT)
            tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
            reader = threading.Thread(target=tail.extend, args=(process.stdout,), daemon=True)
            reader.start()  # keeps draining the pipe, so a chatty program never blocks on it
            running.append((peer, program, process, tail, reader, time.monotonic()))
    results = []
    for peer, program, process, tail, reader, started in running:
        try:
            code = process.wait(timeout=max(0.0, started + program.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        reader.join(timeout=5)
        results.append(ProgramResult(peer, program.command, code, time.monotonic() - started, "".join(tail)))
    return results


def _resolve_python(command: list[str]) -> list[str]:
    """`python` means this interpreter (the one with Plexus installed), as users expect in a venv."""
    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else command
