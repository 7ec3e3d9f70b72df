"""Launch the Go libp2p daemon (p2pd) as a test peer, with an identity chosen by the test.

The daemon is started with a plain `subprocess.Popen`, not an asyncio subprocess, so that a
fixture can always kill and reap it at teardown, even after the test's event loop is gone.
Readiness is "IDENTIFY answers on the control socket with the peer id we gave it", polled with a
deadline. Everything the daemon owns (control socket, key file, log, handler sockets) lives in
one short temporary directory: unix socket paths must stay under ~104 bytes, which pytest's
tmp_path does not guarantee.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from plexus.p2p.identity import PeerID, PrivateKey

from .client import ControlClient

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = REPO_ROOT / ".cache" / "p2pd" / "p2pd"


def find_binary() -> Path:
    """$P2PD_BINARY if set, else where scripts/fetch_p2pd.py puts it."""
    return Path(os.environ.get("P2PD_BINARY") or DEFAULT_BINARY)


def _flag(name: str, value: bool) -> str:
    return f"-{name}={int(value)}"


class Daemon:
    """One p2pd process listening on 127.0.0.1 TCP with Noise only (TLS off)."""

    def __init__(
        self,
        binary: Path | None = None,
        *,
        key: PrivateKey | None = None,
        dht: bool = False,
        dht_server: bool = False,
        dht_client: bool = False,
        relay: bool = False,
        relay_service: bool = False,
        auto_relay: bool = False,
        autonat: bool = False,
        host_addrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",),
        bootstrap_peers: tuple[str, ...] = (),
        extra_args: tuple[str, ...] = (),
    ):
        self.binary = Path(binary or find_binary())
        self.key = key or PrivateKey.generate()
        self.peer_id: PeerID = self.key.peer_id
        self.addrs: list[str] = []
        self.dir = Path(tempfile.mkdtemp(prefix="p2pd-"))
        self.control_socket = str(self.dir / "p2pd.sock")
        self._clients = itertools.count()
        self.process: subprocess.Popen | None = None
        key_file = self.dir / "identity.key"
        key_file.write_bytes(self.key.to_protobuf())
        key_file.chmod(0o400)
        self.args = [
            str(self.binary),
            f"-listen=/unix{self.control_socket}",
            f"-hostAddrs={','.join(host_addrs)}",
            f"-id={key_file}",
            "-q",
            _flag("noise", True),
            _flag("tls", False),
            _flag("autonat", autonat),
            _flag("natPortMap", False),
            _flag("relay", relay),
            _flag("relayService", relay_service),
            _flag("autoRelay", auto_relay),
        ]
        for name, enabled in (("dht", dht), ("dhtServer", dht_server), ("dhtClient", dht_client)):
            if enabled:
                self.args.append(_flag(name, True))
        if bootstrap_peers:
            self.args += [f"-bootstrapPeers={','.join(bootstrap_peers)}", "-b"]
        self.args += list(extra_args)

    async def start(self, timeout: float = 15.0) -> Daemon:
        """Start the process and return once IDENTIFY confirms our identity and listen addresses."""
        self._log = open(self.dir / "daemon.log", "wb")
        self.process = subprocess.Popen(
            self.args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.dir
        )
        client = ControlClient(self.control_socket, str(self.dir / "ready.sock"), timeout=2.0)
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, tail = self.process.returncode, self.log_tail()
                self.stop()
                raise RuntimeError(f"p2pd exited with {code} while starting:\n{tail}")
            if os.path.exists(self.control_socket):
                try:
                    peer_id, addrs = await client.identify()
                except (TimeoutError, OSError, asyncio.IncompleteReadError) as error:
                    last_error = error
                else:
                    if peer_id != self.peer_id:
                        raise RuntimeError(f"p2pd reports peer id {peer_id}, not {self.peer_id} (our key)")
                    if addrs:
                        self.addrs = addrs
                        return self
            await asyncio.sleep(0.02)  # poll interval, bounded by the deadline above
        tail = self.log_tail()  # read before stop() deletes the directory
        self.stop()
        raise TimeoutError(f"p2pd not ready after {timeout} s (last error: {last_error!r}):\n{tail}")

    def client(self, timeout: float = 10.0) -> ControlClient:
        """A new control client; each gets its own socket for inbound streams."""
        handler_socket = self.dir / f"client-{next(self._clients)}.sock"
        return ControlClient(self.control_socket, str(handler_socket), timeout)

    @property
    def maddrs(self) -> list[str]:
        """Listen addresses with /p2p/<id> appended, ready to dial."""
        return [f"{addr}/p2p/{self.peer_id}" for addr in self.addrs]

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return (self.dir / "daemon.log").read_bytes()[-limit:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 5.0) -> None:
        """Terminate (then kill) and reap the process, then remove its directory. Idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"<p2pd {self.peer_id.short()} {self.addrs}>"
