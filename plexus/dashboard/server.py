"""The dashboard's HTTP server, run on the DHT's own event loop (one loop per process).

    dashboard = Dashboard(dht, run_id="albert", port=8080)   # http://127.0.0.1:8080/
    ...
    dashboard.shutdown()                                    # before dht.shutdown()

`/` is the page, `/assets/NAME` its script and style (shipped in the package: no CDN, no internet),
`/api/state` the JSON the page polls (`?history=N`: only the newest N points of the speed history).
Every route is a GET that reads; nothing here changes the swarm. Every `refresh_period` seconds
the server reads the progress records and what the host knows of each peer, and hands both to the
`SwarmCollector`.
"""

import asyncio
import contextlib
import importlib.resources
import json
import re
from typing import Any

from ..dht.crypto import Ed25519SignatureValidator
from ..dht.dht import DHT
from ..errors import UsageError
from ..optim.progress_tracker import progress_validators
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..utils.logging import RateLimitedLog, get_logger
from ..utils.timing import get_dht_time
from .collector import NodeInfo, PeerSighting, SwarmCollector, read_progress
from .log_buffer import LogBuffer

logger = get_logger(__name__)
INSTALL_HINT = "the dashboard needs aiohttp: pip install plexus[dashboard]"
ASSETS = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
}
MAX_SIGHTINGS = 2000


def require_aiohttp():
    """aiohttp's web module, or a UsageError that says what to install."""
    try:
        from aiohttp import web
    except ImportError as error:
        raise UsageError(INSTALL_HINT) from error
    return web


class Dashboard:
    """Serves a live, read-only view of the swarm that `dht` sees (see the module docstring).

    `run_id`: the training run whose progress records (`{run_id}_progress`) to show; without one
    the page shows this node's DHT peers only. `target_batch_size`: the run's, for the ETA (else
    estimated). `stale_after`: seconds after which a peer's last report no longer counts."""

    def __init__(
        self,
        dht: DHT,
        run_id: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        refresh_period: float = 1.0,
        target_batch_size: int | None = None,
        stale_after: float = 30.0,
        start: bool = True,
    ):
        self._web = require_aiohttp()
        if refresh_period <= 0:
            raise UsageError(f"refresh_period must be positive, got {refresh_period}")
        self.dht, self.host, self.port, self.refresh_period = dht, host, port, refresh_period
        self.collector = SwarmCollector(run_id, target_batch_size=target_batch_size, stale_after=stale_after)
        self.log_buffer = LogBuffer()
        if run_id is not None:  # to read the signed records, the node must know how they are checked
            signer = Ed25519SignatureValidator(dht.private_key)
            dht.add_validators(progress_validators(run_id, signer, self.collector.bounds))
        self._assets = {
            name: (importlib.resources.files(__package__) / "assets" / name).read_text() for name in ASSETS
        }
        self._read_failures = RateLimitedLog(logger)
        self._runner: Any = None  # aiohttp's AppRunner, once started
        self._poller: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> None:
        self.log_buffer.attach("plexus")
        try:
            self.dht.run_coroutine(self._start)
        except BaseException:
            self.log_buffer.detach()
            raise

    async def _start(self, dht: DHT, node) -> None:
        web = self._web
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/assets/{name}", self._asset)
        app.router.add_get("/api/state", self._state)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as error:
            await runner.cleanup()
            raise UsageError(f"the dashboard cannot listen on {self.host}:{self.port}: {error}") from error
        self._runner = runner
        self._loop = loop = asyncio.get_running_loop()
        self.port = runner.addresses[0][1]
        self._poller = loop.create_task(self._poll(node))

    def record_step(self, step: int, loss: float, samples_per_second: float, time: float) -> None:
        """Add a global step to the loss curve (thread-safe; the monitor calls it)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.collector.record_step, step, loss, samples_per_second, time)

    def shutdown(self) -> None:
        self.log_buffer.detach()
        if self._runner is not None and self.dht.is_alive():
            self.dht.run_coroutine(self._stop)
        self._runner = None

    async def _stop(self, dht: DHT, node) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._runner is not None:
            await self._runner.cleanup()

    # --- reading the swarm ---------------------------------------------------------------------------

    async def _poll(self, node) -> None:
        while True:
            try:
                await self._observe(node)
            except Exception as error:  # a lookup that failed or timed out: the next read tries again
                self._read_failures.warning(("read",), f"the dashboard could not read the swarm: {error!r}")
            await asyncio.sleep(self.refresh_period)  # the refresh period, not synchronisation

    async def _observe(self, node) -> None:
        found = None
        if self.collector.progress_key is not None:
            async with asyncio.timeout(max(5.0, 5 * self.refresh_period)):
                found = await node.get(self.collector.progress_key, latest=True)
        now = get_dht_time()
        reading = read_progress(found, now, self.collector.stale_after, self.collector.bounds)
        for signer, wrong in reading.rejected:  # shown under "recent warnings", once a minute per peer
            self._read_failures.warning(
                ("record", signer), f"ignoring the progress record of {signer}: {wrong}"
            )
        peers = {
            str(peer_id): (peer_id, node.routing_table.last_seen(node_id))
            for node_id, peer_id in node.routing_table
        }
        for name, report in reading.reports.items():  # keyed by the signer, who is the record's peer
            peers.setdefault(name, (PeerID(report.peer_id), None))
        host = self._host()
        for peer_id in host.connected_peers():
            peers.setdefault(str(peer_id), (peer_id, None))
        sightings = [self._sighting(name, peer_id, seen) for name, (peer_id, seen) in peers.items()]
        node_info = NodeInfo(
            peer_id=str(self.dht.peer_id),
            addresses=tuple(str(addr) for addr in host.get_visible_maddrs()),
            reachability=self.dht.reachability,
            nat_mode=self.dht.nat_mode,
            routing_table_size=len(node.routing_table),
        )
        self.collector.observe(now, reading, sightings[:MAX_SIGHTINGS], node_info)

    def _host(self) -> Host:
        if self.dht.host is None:
            raise RuntimeError("the dashboard reads a DHT that is not running")
        return self.dht.host

    def _sighting(self, name: str, peer_id: PeerID, last_seen: float | None) -> PeerSighting:
        info = self._host().peer_info(peer_id)
        connections = self._host().connections_to(peer_id)
        return PeerSighting(
            peer_id=name,
            addresses=tuple(str(addr) for addr in info.addrs) if info is not None else (),
            connected=bool(connections),
            relayed=bool(connections) and all(getattr(c, "relayed", False) for c in connections),
            last_seen=last_seen,
        )

    # --- HTTP ----------------------------------------------------------------------------------------

    async def _page(self, request):
        return self._web.Response(
            text=self._assets["index.html"], content_type=ASSETS["index.html"], headers=HEADERS
        )

    async def _asset(self, request):
        name = request.match_info["name"]
        if name not in ASSETS or name == "index.html":
            raise self._web.HTTPNotFound(text="no such asset")
        return self._web.Response(text=self._assets[name], content_type=ASSETS[name], headers=HEADERS)

    async def _state(self, request):
        unknown = sorted(set(request.query) - {"history"})
        if unknown:
            return self._bad_request(f"unknown query parameter {unknown[0][:64]!r}; only history=N is known")
        history = None
        if "history" in request.query:
            values = request.query.getall("history")
            if len(values) != 1 or not re.fullmatch(r"[0-9]{1,7}", values[0]):
                return self._bad_request("history must be one whole number of points, e.g. history=300")
            history = min(int(values[0]), self.collector.history_length)
        state = self.collector.state(get_dht_time(), history, self.log_buffer.records())
        return self._web.Response(
            text=json.dumps(state, allow_nan=False), content_type="application/json", headers=HEADERS
        )

    def _bad_request(self, message: str):
        return self._web.json_response(dict(error=message), status=400, headers=HEADERS)
