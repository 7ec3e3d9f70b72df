"""MoEBeamSearcher: drives `BeamSearch` over the DHT, a whole batch at a time.

Every sample of a batch gets its own `BeamSearch`; each round, the prefixes all of them want are
fetched in one `get_many` (a prefix two samples need is fetched once), parsed, and fed back. The
number of rounds is about the number of grid dimensions, not the batch size.

Negative caching: a prefix the DHT knows nothing about gets a marker entry (see
`expert_registry.EMPTY_PREFIX_SUBKEY`) stored for `cache_expiration` seconds, in the background,
so the next searches (ours, through the local cache, and other peers') skip the network lookup.
The price: an expert announced under that prefix later is invisible to this peer until the marker
expires (hivemind has the same trade-off); turn it off with `negative_caching=False`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

from ...dht.node import DHTNode
from ...utils.logging import get_logger
from ...utils.timing import get_dht_time
from ..expert_registry import EMPTY_PREFIX_SUBKEY, learn_addresses, parse_successors
from ..expert_uid import UID_DELIMITER, ExpertInfo, ExpertPrefix, is_valid_prefix
from .beam import BeamSearch, Successors
from .expert import RemoteExpert

logger = get_logger(__name__)

MAX_NEGATIVE_CACHE_TASKS = 64  # background stores in flight; past this, empty prefixes go uncached


def _as_floats(scores) -> list[float]:
    return scores.tolist() if hasattr(scores, "tolist") else [float(x) for x in scores]


class MoEBeamSearcher:
    """Finds the best experts of a grid for given gating scores.

    Args:
        dht: a running plexus.DHT (its host is what RemoteExperts returned here call through).
        uid_prefix: the grid's name, e.g. `ffn.` (a missing trailing delimiter is added).
        grid_size: experts per dimension.
        negative_caching: remember empty prefixes in the DHT for `cache_expiration` seconds.
        num_workers: accepted for hivemind compatibility; lookups are batched instead.
    """

    def __init__(
        self,
        dht,
        uid_prefix: str,
        grid_size: Sequence[int],
        num_workers: int | None = None,
        negative_caching: bool = True,
        cache_expiration: float = 300,
    ):
        if not uid_prefix.endswith(UID_DELIMITER):
            uid_prefix += UID_DELIMITER
        if not is_valid_prefix(uid_prefix):
            raise ValueError(f"{uid_prefix!r} is not a valid uid prefix (a name, coordinates, e.g. 'ffn.')")
        if not grid_size or any(int(size) < 1 for size in grid_size):
            raise ValueError(f"grid_size must be a non-empty sequence of positive sizes, got {grid_size}")
        self.dht, self.uid_prefix, self.grid_size = dht, uid_prefix, tuple(int(size) for size in grid_size)
        self.num_workers, self.negative_caching = num_workers, negative_caching
        self.cache_expiration = cache_expiration
        self._caching_tasks: set[asyncio.Task] = set()

    # --- asyncio API (on the DHT's loop) --------------------------------------------------------------

    async def fetch_successors(
        self, node: DHTNode, prefixes: Sequence[ExpertPrefix]
    ) -> dict[ExpertPrefix, Successors]:
        """The populated next coordinates of each prefix (empty dict: none), from one DHT lookup."""
        found = await node.get_many(list(prefixes))
        result: dict[ExpertPrefix, Successors] = {}
        for prefix in prefixes:
            record = found.get(prefix)
            depth = prefix[len(self.uid_prefix) :].count(UID_DELIMITER)
            grid = self.grid_size[depth] if depth < len(self.grid_size) else None
            result[prefix] = parse_successors(prefix, record.value, grid) if record is not None else {}
            if record is None and self.negative_caching:
                self._cache_empty(node, prefix)
        return result

    def _cache_empty(self, node: DHTNode, prefix: ExpertPrefix) -> None:
        if len(self._caching_tasks) >= MAX_NEGATIVE_CACHE_TASKS:
            return
        logger.debug(f"no experts under {prefix}: caching that for {self.cache_expiration} s")
        task = asyncio.get_running_loop().create_task(
            node.store(prefix, None, get_dht_time() + self.cache_expiration, subkey=EMPTY_PREFIX_SUBKEY)
        )
        self._caching_tasks.add(task)
        task.add_done_callback(self._caching_done)

    def _caching_done(self, task: asyncio.Task) -> None:
        self._caching_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug(f"negative caching failed: {task.exception()!r}")

    async def batch_find_best_experts_async(
        self, node: DHTNode, batch_grid_scores: Sequence[Sequence], beam_size: int
    ) -> list[list[ExpertInfo]]:
        """For each sample (a list of per-dimension scores), its best experts, best first."""
        searches = []
        for grid_scores in batch_grid_scores:
            scores = [_as_floats(s) for s in grid_scores]
            # as in hivemind, a dimension may be scored short: coordinates past its scores are not chosen
            if len(scores) != len(self.grid_size) or any(len(s) > n for s, n in zip(scores, self.grid_size)):
                raise ValueError(
                    f"scores of sizes {[len(s) for s in scores]} do not fit grid_size {self.grid_size}"
                )
            searches.append(BeamSearch(self.uid_prefix, scores, beam_size))
        known: dict[ExpertPrefix, Successors] = {}
        while True:
            active = [search for search in searches if not search.done]
            if not active:
                break
            missing = list(dict.fromkeys(p for search in active for p in search.wanted() if p not in known))
            if missing:
                known.update(await self.fetch_successors(node, missing))
            for search in active:
                search.feed(known)
        return [[ExpertInfo(uid, peer_id) for uid, peer_id in search.result()] for search in searches]

    async def find_best_experts_async(
        self, node: DHTNode, grid_scores: Sequence, beam_size: int
    ) -> list[ExpertInfo]:
        return (await self.batch_find_best_experts_async(node, [grid_scores], beam_size))[0]

    # --- synchronous API (hivemind's) -----------------------------------------------------------------

    def _remote(self, infos: list[ExpertInfo]) -> list[RemoteExpert]:
        return [RemoteExpert(info, self.dht.host) for info in infos]

    def find_best_experts(
        self, grid_scores: Sequence, beam_size: int, return_future: bool = False
    ) -> list[RemoteExpert] | concurrent.futures.Future:
        """The `beam_size` best experts for one sample's per-dimension scores, best first."""

        async def search(dht, node):
            infos = await self.find_best_experts_async(node, grid_scores, beam_size)
            await learn_addresses(node, dht.host, [info.peer_id for info in infos])
            return self._remote(infos)

        return self.dht.run_coroutine(search, return_future=return_future)

    def batch_find_best_experts(
        self,
        batch_grid_scores: Sequence,
        beam_size: int,
        return_future: bool = False,
    ) -> list[list[RemoteExpert]] | concurrent.futures.Future:
        """`find_best_experts` for each sample. `batch_grid_scores` is a list of samples, each a list
        of per-dimension scores (hivemind takes per-dimension [batch, size] arrays; both work)."""
        samples = _samples(batch_grid_scores, len(self.grid_size))

        async def search(dht, node):
            found = await self.batch_find_best_experts_async(node, samples, beam_size)
            await learn_addresses(node, dht.host, [info.peer_id for infos in found for info in infos])
            return [self._remote(infos) for infos in found]

        return self.dht.run_coroutine(search, return_future=return_future)

    async def get_initial_beam_async(
        self, node: DHTNode, scores: Sequence[float], beam_size: int
    ) -> list[tuple[float, ExpertPrefix, Successors]]:
        """The first step of a search: (score, prefix, successors) of the `beam_size` best-scoring
        populated prefixes `uid_prefix{i}.` of the first dimension, best first. Prefixes are looked
        up best first, `beam_size` per DHT lookup, until enough are found or none are left."""
        scores = _as_floats(scores)
        order = sorted(range(len(scores)), key=lambda index: -scores[index])
        beam: list[tuple[float, ExpertPrefix, Successors]] = []
        while order and len(beam) < beam_size:
            batch, order = order[:beam_size], order[beam_size:]
            prefixes = [f"{self.uid_prefix}{index}{UID_DELIMITER}" for index in batch]
            found = await self.fetch_successors(node, prefixes)
            beam += [
                (scores[index], prefix, found[prefix])
                for index, prefix in zip(batch, prefixes)
                if found[prefix]
            ]
        return beam[:beam_size]

    def get_initial_beam(self, scores: Sequence[float], beam_size: int, return_future: bool = False):
        """`get_initial_beam_async` from any thread (hivemind's API)."""

        async def fetch(dht, node):
            return await self.get_initial_beam_async(node, scores, beam_size)

        return self.dht.run_coroutine(fetch, return_future=return_future)

    def get_active_successors(self, prefixes: Sequence[ExpertPrefix]) -> dict[ExpertPrefix, Successors]:
        """The populated next coordinates of each prefix, as read from the DHT now."""
        bad = [prefix for prefix in prefixes if not is_valid_prefix(prefix)]
        if bad:
            raise ValueError(f"invalid prefixes {bad[:3]}: a prefix ends with the delimiter, e.g. 'ffn.3.'")

        async def fetch(dht, node):
            return await self.fetch_successors(node, list(prefixes))

        return self.dht.run_coroutine(fetch)


def _samples(batch_grid_scores, dims: int) -> list:
    """Per-sample lists of per-dimension scores, from either that or per-dimension [batch, size] arrays."""
    if len(batch_grid_scores) == dims and all(getattr(s, "ndim", 0) == 2 for s in batch_grid_scores):
        batch = batch_grid_scores[0].shape[0]
        return [[scores[i] for scores in batch_grid_scores] for i in range(batch)]
    return list(batch_grid_scores)
