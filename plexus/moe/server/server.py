"""The expert server: module backends + the batching runtime + the RPC service on one Host.

`Server(host, backends)` serves existing backends; `Server.create(...)` builds them from a
registered expert class. Start-up restores checkpoints, starts the compute thread and registers
the `/plexus/moe/...` handlers on the host (which runs on the process's background loop);
a periodic task on that loop saves checkpoints every `update_period` through the compute thread,
so a checkpoint never sees a half-applied optimizer step. Shutdown saves once more, fails the
requests still waiting, and leaves no thread or task behind.

Given a DHT, the server serves on the DHT's own host and announces its experts there
(`expert_registry.declare_experts`): once at start-up, after the handlers are registered (so an
expert is never found before it answers), and again every `update_period` from the periodic
task, each announcement living `expiration` seconds. A server that stops simply stops renewing;
its entries expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from ...compression import CompressionType
from ...dht.dht import DHT
from ...p2p.host import Host, PeerInfo
from ...utils.background_loop import get_background_loop
from ...utils.logging import get_logger
from ...utils.timing import get_dht_time
from ..expert_registry import declare_experts_async
from ..expert_uid import is_valid_uid, sample_expert_uids
from ..schema import BatchTensorDescriptor
from .checkpoints import DEFAULT_KEEP_LAST, load_experts, saved_expert_uids, store_experts
from .handler import DEFAULT_MAX_REQUESTS_PER_PEER, DEFAULT_REQUEST_TIMEOUT, ConnectionHandler
from .layers import ClippingWrapper, name_to_block, name_to_input, schedule_name_to_scheduler
from .module_backend import DUMMY_BATCH_SIZE, ModuleBackend
from .runtime import Runtime

logger = get_logger(__name__)

START_TIMEOUT = 30.0


class Server:
    """Serves `module_backends` (uid -> ModuleBackend) to RemoteExperts.

    Args:
        host_or_dht: a running plexus.DHT (the experts are served on its host and announced in it),
            or a started `plexus.p2p.Host` on the background loop (served, not announced).
        module_backends: the experts, by uid.
        update_period: seconds between checkpoints (and, with a DHT, re-announcements).
        expiration: lifetime of an announcement in the DHT (default max(2 * update_period, 3)).
        start: start serving now.
        checkpoint_dir: restore experts from here at start-up and save them every update_period.
        request_timeout: bound on one RPC, reading and queueing included.
        max_requests_per_peer: forward and backward calls one peer may have under way at once.
        keep_checkpoints: timestamped checkpoints kept per expert.
    """

    def __init__(
        self,
        host_or_dht,
        module_backends: dict[str, ModuleBackend],
        *,
        update_period: float = 30.0,
        expiration: float | None = None,
        start: bool = False,
        checkpoint_dir: str | Path | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        keep_checkpoints: int = DEFAULT_KEEP_LAST,
        max_requests_per_peer: int = DEFAULT_MAX_REQUESTS_PER_PEER,
    ):
        if isinstance(host_or_dht, Host):
            self.host, self.dht = host_or_dht, None
        else:
            self.dht = host_or_dht
            self.host = getattr(host_or_dht, "host", None)
            if self.host is None:
                raise TypeError(f"Server needs a started plexus.DHT or plexus.p2p.Host, got {host_or_dht!r}")
            if getattr(host_or_dht, "client_mode", False):
                raise ValueError(
                    "an expert server must accept connections, but its DHT is in client_mode; "
                    "start the DHT without client_mode (and with reachable host_maddrs)"
                )
        self.module_backends = dict(module_backends)
        for uid, backend in self.module_backends.items():
            if backend.name != uid:
                raise ValueError(f"module_backends maps {uid!r} to a backend named {backend.name!r}")
        self.update_period = update_period
        self.expiration = expiration if expiration is not None else max(2 * update_period, 3)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_checkpoints = keep_checkpoints
        self.runtime = Runtime.from_backends(self.module_backends)
        self.handler = (
            ConnectionHandler(
                self.host,
                self.module_backends,
                request_timeout=request_timeout,
                max_requests_per_peer=max_requests_per_peer,
            )
            if self.host is not None
            else None
        )
        self.ready = threading.Event()
        self._stopped = threading.Event()
        self._periodic: asyncio.Task | None = None
        self._owns_host = False
        self._owns_dht = False
        if start:
            self.run_in_background(await_ready=True)

    # --- life cycle ---------------------------------------------------------------------------------

    def run_in_background(self, await_ready: bool = True, timeout: float | None = START_TIMEOUT) -> None:
        """Start serving and return once ready (hivemind's name; the work runs on the compute thread and
        the background loop, so there is no thread of the server's own to wait for)."""
        self.start(timeout)

    def start(self, timeout: float | None = START_TIMEOUT) -> None:
        if self.ready.is_set():
            return
        if self.checkpoint_dir is not None:
            load_experts(self.module_backends, self.checkpoint_dir)
        self.runtime.start()
        try:
            get_background_loop().run(self._start_on_loop(), timeout)
        except BaseException:
            self.runtime.shutdown()
            raise
        self._stopped.clear()
        self.ready.set()
        if self.dht is not None:
            self._declare_experts()
        logger.debug(f"serving {len(self.module_backends)} experts as {self.host.peer_id}")

    async def _start_on_loop(self) -> None:
        self.handler.register()
        if self.checkpoint_dir is not None or self.dht is not None:
            self._periodic = asyncio.get_running_loop().create_task(self._every_update_period())

    def run(self) -> None:
        """Start and serve until `shutdown()` is called from another thread (or a signal handler)."""
        self.start()
        self._stopped.wait()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the server has shut down; True if it has."""
        return self._stopped.wait(timeout)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop serving: unregister the handlers, save checkpoints, stop the compute thread."""
        if not self.ready.is_set():
            self._release_owned(timeout)
            return
        self.ready.clear()
        get_background_loop().run(self._stop_on_loop(), timeout)
        if self.checkpoint_dir is not None:
            try:
                self.runtime.submit_job(self._save_checkpoints).result(timeout)
            except Exception as error:
                logger.warning(f"the final checkpoint failed: {error!r}")
        self.runtime.shutdown(timeout)
        self._release_owned(timeout)
        self._stopped.set()

    def _release_owned(self, timeout: float | None) -> None:
        """Close the DHT or host that `create` made for this server (idempotent)."""
        if self._owns_dht:
            self._owns_dht = False
            self.dht.shutdown()
        if self._owns_host:
            self._owns_host = False
            get_background_loop().run(self.host.shutdown(), timeout)

    async def _stop_on_loop(self) -> None:
        self.handler.unregister()
        if self._periodic is not None:
            self._periodic.cancel()
            await asyncio.gather(self._periodic, return_exceptions=True)
            self._periodic = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # --- periodic work ------------------------------------------------------------------------------

    async def _every_update_period(self) -> None:
        while True:
            await asyncio.sleep(self.update_period)  # a period, not synchronisation
            if self.dht is not None:
                await self._declare_experts_async()
            if self.checkpoint_dir is not None:
                try:
                    await asyncio.wrap_future(self.runtime.submit_job(self._save_checkpoints))
                except Exception as error:
                    logger.warning(
                        f"saving checkpoints to {self.checkpoint_dir} failed: {error!r}; "
                        f"will retry in {self.update_period} s"
                    )

    def _save_checkpoints(self) -> None:
        store_experts(self.module_backends, self.checkpoint_dir, self.keep_checkpoints)

    def _declare_experts(self) -> None:
        """Announce every uid in the DHT for `self.expiration` seconds (from a thread, not the loop)."""
        get_background_loop().run(self._declare_experts_async(), START_TIMEOUT)

    async def _declare_experts_async(self) -> bool:
        """Announce on the loop; a failure is logged and retried at the next update_period."""
        uids = list(self.module_backends)
        try:
            stored = await declare_experts_async(
                self.dht.node, uids, self.host.peer_id, get_dht_time() + self.expiration
            )
        except Exception as error:
            logger.warning(
                f"announcing {len(uids)} experts in the DHT failed: {error!r}; "
                f"retrying in {self.update_period} s"
            )
            return False
        missing = [uid for uid, ok in stored.items() if not ok]
        if missing:
            logger.warning(
                f"{len(missing)} of {len(uids)} experts (e.g. {missing[0]!r}) were not stored by any DHT "
                f"peer; retrying in {self.update_period} s"
            )
        return not missing

    # --- building from a registered expert class ------------------------------------------------------

    @classmethod
    def create(
        cls,
        num_experts: int | None = None,
        expert_uids: list[str] | None = None,
        expert_pattern: str | None = None,
        expert_cls: str = "ffn",
        hidden_dim: int = 1024,
        optim_cls=torch.optim.Adam,
        scheduler: str = "none",
        num_warmup_steps: int | None = None,
        num_training_steps: int | None = None,
        clip_grad_norm: float | None = None,
        num_handlers: int | None = None,
        min_batch_size: int = 1,
        max_batch_size: int = 4096,
        device: str | torch.device | None = None,
        initial_peers=(),
        checkpoint_dir: str | Path | None = None,
        compression: CompressionType = CompressionType.NONE,
        stats_report_interval: float | None = None,
        custom_module_path: str | None = None,
        update_period: float = 30.0,
        expiration: float | None = None,
        *,
        start: bool,
        host: Host | None = None,
        dht=None,
        rng: random.Random | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        max_requests_per_peer: int = DEFAULT_MAX_REQUESTS_PER_PEER,
        **dht_kwargs,
    ) -> Server:
        """Build a server of `expert_cls` experts (hivemind's arguments).

        Network: with neither `dht` nor `host` given, the server starts a DHT of its own
        (`DHT(initial_peers, **dht_kwargs)`, e.g. host_maddrs, announce_maddrs, identity_path),
        announces its experts there and closes it on shutdown. With `host`, it serves without a DHT.

        Experts: `expert_uids`, or `num_experts` taken from the checkpoints in `checkpoint_dir`
        first and then sampled from `expert_pattern` (e.g. `ffn.[0:4].[0:16]`; default `expert.0`,
        `expert.1`, ...). Sampled uids already announced in the DHT are drawn again (up to
        SAMPLING_ATTEMPTS rounds; two servers sampling at the same instant can still collide).

        Optimizer: `optim_cls(params)` (None: experts do not learn), clipped to `clip_grad_norm`,
        with `scheduler` "linear" (needs num_warmup_steps and num_training_steps) or "none". `num_handlers` has no effect: one event loop serves every connection.
        """
        if num_handlers is not None or stats_report_interval is not None:
            warnings.warn(
                "num_handlers and stats_report_interval have no effect in Plexus (one event loop serves "
                "every connection; runtime statistics are not reported yet)",
                stacklevel=2,
            )
        if custom_module_path is not None:
            _import_module_file(custom_module_path)
        if expert_cls not in name_to_block:
            raise ValueError(
                f"unknown expert class {expert_cls!r}; registered: {sorted(name_to_block)} "
                f"(add one with @register_expert_class or custom_module_path)"
            )
        owns_dht = False
        if dht is None and host is None:
            dht = DHT(initial_peers=initial_peers, start=True, **dht_kwargs)
            owns_dht = True
        elif dht_kwargs or initial_peers:
            raise TypeError(
                f"options {sorted(dht_kwargs) + (['initial_peers'] if initial_peers else [])} apply "
                f"only to a DHT the server creates itself (not with dht= or host=)"
            )
        try:
            find_taken = None if dht is None else (lambda candidates: _announced(dht, candidates))
            uids = _choose_uids(
                num_experts, expert_uids, expert_pattern, checkpoint_dir, rng or random.Random(), find_taken
            )
            backends = _make_backends(
                uids,
                expert_cls,
                hidden_dim,
                optim_cls,
                scheduler,
                num_warmup_steps,
                num_training_steps,
                clip_grad_norm,
                min_batch_size,
                max_batch_size,
                torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")),
                compression,
            )
            server = cls(
                host if dht is None else dht,
                backends,
                update_period=update_period,
                expiration=expiration,
                checkpoint_dir=checkpoint_dir,
                request_timeout=request_timeout,
                max_requests_per_peer=max_requests_per_peer,
            )
            server._owns_dht = owns_dht
            if start:
                server.start()
        except BaseException:
            if owns_dht:
                dht.shutdown()
            raise
        return server


SAMPLING_ATTEMPTS = 10


def _announced(dht, uids: list[str]) -> set[str]:
    """The uids some server announces in the DHT right now."""

    async def lookup(_, node):
        found = await node.get_many(uids)
        return {uid for uid, record in found.items() if record is not None}

    return dht.run_coroutine(lookup)


def _make_backends(
    uids,
    expert_cls,
    hidden_dim,
    optim_cls,
    scheduler,
    num_warmup_steps,
    num_training_steps,
    clip_grad_norm,
    min_batch_size,
    max_batch_size,
    device,
    compression,
) -> dict[str, ModuleBackend]:
    sample = name_to_input[expert_cls](DUMMY_BATCH_SIZE, hidden_dim)
    sample = sample if isinstance(sample, (tuple, list)) else (sample,)
    args_schema = tuple(BatchTensorDescriptor.from_tensor(t, compression) for t in sample)
    backends, outputs_schema = {}, None
    for uid in uids:
        module = name_to_block[expert_cls](hidden_dim).to(device)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = optim_cls(params) if optim_cls is not None and params else None
        if optimizer is not None and clip_grad_norm is not None:
            optimizer = ClippingWrapper(optimizer, clip_grad_norm)
        schedule = _make_scheduler(scheduler, optimizer, num_warmup_steps, num_training_steps)
        backends[uid] = backend = ModuleBackend(
            uid,
            module,
            optimizer=optimizer,
            scheduler=schedule,
            args_schema=args_schema,
            outputs_schema=outputs_schema,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
        )
        if outputs_schema is None:  # one dummy forward is enough: the experts share their class
            outputs_schema = backend.outputs_schema if backend.outputs_tuple else backend.outputs_schema[0]
    return backends


def _choose_uids(
    num_experts, expert_uids, expert_pattern, checkpoint_dir, rng: random.Random, find_taken=None
) -> list[str]:
    if expert_uids is not None:
        uids = list(dict.fromkeys(expert_uids))  # a uid given twice is one expert, as in hivemind
        if len(uids) < len(expert_uids):
            logger.info(f"serving {len(uids)} experts: {len(expert_uids) - len(uids)} uids were given twice")
        if num_experts is not None and num_experts != len(uids):
            raise ValueError(f"num_experts={num_experts} disagrees with the {len(uids)} distinct expert_uids")
    else:
        uids = saved_expert_uids(checkpoint_dir) if checkpoint_dir is not None else []
        if num_experts is None and not uids:
            raise ValueError("say which experts to serve: num_experts (with expert_pattern), or expert_uids")
        missing = (num_experts or 0) - len(uids)
        if missing > 0 and expert_pattern is not None:
            uids += _sample_free(expert_pattern, missing, rng, set(uids), find_taken)
        elif missing > 0:
            taken = set(uids)
            uids += [
                uid
                for uid in (f"expert.{i}" for i in range(len(uids) + missing + len(taken)))
                if uid not in taken
            ][:missing]
    bad = [uid for uid in uids if not is_valid_uid(uid)]
    if bad:
        raise ValueError(
            f"invalid expert uids {bad[:5]}: a uid is a name and integer coordinates, e.g. 'ffn.0.3'"
        )
    return uids


def _sample_free(pattern: str, count: int, rng: random.Random, exclude: set[str], find_taken) -> list[str]:
    """`count` uids of the pattern, none in `exclude` nor (through `find_taken`) announced by others."""
    chosen: list[str] = []
    for _ in range(SAMPLING_ATTEMPTS):
        try:
            candidates = sample_expert_uids(
                pattern, count - len(chosen), rng=rng, exclude=exclude | set(chosen)
            )
        except ValueError:  # fewer free uids in the grid than still needed
            break
        taken = find_taken(candidates) if find_taken is not None else set()
        chosen += [uid for uid in candidates if uid not in taken]
        exclude |= taken
        if len(chosen) == count:
            return chosen
    raise ValueError(
        f"could not find {count} uids of {pattern!r} that no other server announces "
        f"({len(chosen)} found, {len(exclude)} taken); use a larger grid or fewer experts"
    )


def _make_scheduler(name: str, optimizer, num_warmup_steps, num_training_steps):
    if name not in schedule_name_to_scheduler:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(schedule_name_to_scheduler)}")
    make = schedule_name_to_scheduler[name]
    if make is None or optimizer is None:
        return None
    if num_warmup_steps is None or num_training_steps is None:
        raise ValueError(f"the {name} schedule needs num_warmup_steps and num_training_steps")
    return make(optimizer, num_warmup_steps, num_training_steps)


def _import_module_file(path: str) -> None:
    """Run a user's Python file (its @register_expert_class decorators register new experts)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"plexus_custom_experts_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import custom module {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


@contextlib.contextmanager
def background_server(*args, shutdown_timeout: float = 5, **kwargs) -> Iterator[PeerInfo]:
    """`Server.create(*args, **kwargs)` serving in this process for the duration of the block.

    Yields the server's PeerInfo: its peer id and addresses, which also serve as `initial_peers`
    for joining the server's DHT. Unlike hivemind, no child process is forked: the server runs on
    the background loop and its compute thread. Listens on 127.0.0.1 unless `host_maddrs` says
    otherwise.
    """
    if "host" not in kwargs and "dht" not in kwargs:
        kwargs.setdefault("host_maddrs", ("/ip4/127.0.0.1/tcp/0",))
    server = Server.create(*args, start=True, **kwargs)
    try:
        yield PeerInfo(server.host.peer_id, server.host.get_visible_maddrs())
    finally:
        server.shutdown(shutdown_timeout)
