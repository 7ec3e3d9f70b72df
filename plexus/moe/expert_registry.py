"""Experts in the DHT: how a server announces its uids and how clients find them.

Layout (the beam search in `client/beam_search.py` walks it):

- `uid` -> the server's peer id (base58), a plain value: `get_experts` reads these.
- `prefix` -> a dictionary, one entry per next coordinate: subkey `coordinate`, value
  `(some uid under prefix.coordinate, its server's peer id)`, for every level of `prefix_entries`.
  The walk learns from one entry both that `prefix.coordinate.` is populated and one expert in it.
- A prefix found empty may get a marker entry (subkey `EMPTY_PREFIX_SUBKEY`, value None) from a
  client's negative cache. The marker's subkey is a string so that it can never shadow the
  FLAT_EXPERT (-1) entry of a one-dimensional uid announced under the same prefix (in hivemind the
  two share subkey -1, so a cached "empty" could hide a server that starts later).

Values read from the DHT come from anyone: `parse_successors` keeps only well-formed entries whose
uid lies under the prefix and coordinate it is filed under.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

from ..dht.node import DHTNode
from ..dht.routing import DHTID
from ..p2p.host import Host
from ..p2p.identity import PeerID
from ..utils.timing import DHTExpiration
from .client.expert import RemoteExpert
from .expert_uid import (
    UID_DELIMITER,
    Coordinate,
    ExpertInfo,
    ExpertPrefix,
    ExpertUID,
    is_valid_uid,
    prefix_entries,
)

EMPTY_PREFIX_SUBKEY = "empty"  # the negative-cache marker's subkey (never an int coordinate)


def declaration_entries(uids: Sequence[ExpertUID], peer_id: PeerID) -> tuple[list, list, list]:
    """(keys, subkeys, values) for store_many: each uid, then each of its prefix entries once."""
    peer = peer_id.to_base58()
    entries: dict[tuple[str, Coordinate | None], object] = {}
    for uid in uids:
        entries[uid, None] = peer
        for prefix, coordinate in prefix_entries(uid):
            entries[prefix, coordinate] = (uid, peer)
    keys, subkeys, values = [], [], []
    for (key, subkey), value in entries.items():
        keys.append(key)
        subkeys.append(subkey)
        values.append(value)
    return keys, subkeys, values


async def store_declarations(
    node: DHTNode, uids: Sequence[ExpertUID], peer_id: PeerID, expiration_time: DHTExpiration
) -> dict:
    """Store the records that announce `uids`; whether each was stored, by record: `uid` for the
    plain ones, `(prefix, coordinate)` for the prefix entries."""
    if not uids:
        return {}
    keys, subkeys, values = declaration_entries(uids, peer_id)
    return await node.store_many(keys, values, expiration_time, subkeys=subkeys)


async def declare_experts_async(
    node: DHTNode, uids: Sequence[ExpertUID], peer_id: PeerID, expiration_time: DHTExpiration
) -> dict[ExpertUID, bool]:
    """Announce `uids` as served by `peer_id` until `expiration_time`; {uid: every record stored}."""
    stored = await store_declarations(node, uids, peer_id, expiration_time)
    result = {}
    for uid in uids:
        records = [uid, *prefix_entries(uid)]  # store_many names dictionary entries (key, subkey)
        result[uid] = all(stored.get(record, False) for record in records)
    return result


def declare_experts(
    dht, uids: Sequence[ExpertUID], expiration_time: DHTExpiration, wait: bool = True
) -> dict | concurrent.futures.Future:
    """Announce that this DHT peer serves `uids` until `expiration_time` (absolute DHT time).

    Returns, as hivemind does, whether each record was stored: `{uid: ok, (prefix, coordinate): ok}`
    (the prefix entries are shared by uids, so there are fewer than one per uid and level), or a
    future of it with `wait=False`. The server's Host must be the DHT's own (`dht.host`).
    """
    if isinstance(uids, str):
        raise TypeError("declare_experts takes a list of uids, not one uid string")
    for uid in uids:
        if not is_valid_uid(uid):
            raise ValueError(f"{uid!r} is not a valid expert uid (expected name.i[.j...], e.g. 'ffn.0.3')")

    async def declare(dht_, node):
        return await store_declarations(node, list(uids), dht_.peer_id, expiration_time)

    return dht.run_coroutine(declare, return_future=not wait)


async def learn_addresses(node: DHTNode, host: Host, peer_ids: Sequence[PeerID]) -> None:
    """Look up, in one DHT traversal, the addresses of the peers the host cannot dial yet.

    The host's own peer routing does the same lookup lazily, from inside a dial; there the lookup
    may query the very peer being dialed, join that pending dial and stall until the DHT's
    wait_timeout. Doing it first, outside any dial, avoids that.
    """
    unknown = [
        peer
        for peer in dict.fromkeys(peer_ids)
        if peer != host.peer_id
        and host.get_connection(peer) is None
        and not getattr(host.peer_info(peer), "addrs", None)
    ]
    if unknown:
        await node.find_nearest_nodes(
            [DHTID.generate(source=peer.to_bytes()) for peer in unknown], exclude_self=True
        )


def _peer_id(text: object) -> PeerID | None:
    if not isinstance(text, str) or len(text) > 128:
        return None
    try:
        return PeerID.from_base58(text)
    except Exception:  # whatever a peer stored, a bad id is only a missing expert
        return None


async def get_experts_async(
    node: DHTNode, host: Host, uids: Sequence[ExpertUID], expiration_time: DHTExpiration | None = None
) -> list[RemoteExpert | None]:
    """`get_experts` for asyncio code on the DHT's loop."""
    if not uids:
        return []
    found = await node.get_many(list(dict.fromkeys(uids)), sufficient_expiration_time=expiration_time)
    experts = []
    for uid in uids:
        record = found.get(uid)
        peer_id = _peer_id(record.value) if record is not None else None
        experts.append(RemoteExpert(ExpertInfo(uid, peer_id), host) if peer_id is not None else None)
    await learn_addresses(node, host, [expert.peer_id for expert in experts if expert is not None])
    return experts


def create_remote_experts(
    infos: Sequence[ExpertInfo | None],
    dht,
    return_future: bool = False,
) -> list[RemoteExpert | None] | concurrent.futures.Future:
    """A RemoteExpert for each ExpertInfo (None stays None), calling through the DHT's host, whose
    DHT finds the servers' addresses. `infos` may also be a future of that list (hivemind's
    `get_experts(..., return_future=True)` result)."""

    async def create(dht_, node):
        found = await asyncio.wrap_future(infos) if isinstance(infos, concurrent.futures.Future) else infos
        experts = [None if info is None else RemoteExpert(ExpertInfo(*info), dht_.host) for info in found]
        await learn_addresses(node, dht_.host, [expert.peer_id for expert in experts if expert is not None])
        return experts

    return dht.run_coroutine(create, return_future=return_future)


def get_experts(
    dht, uids: Sequence[ExpertUID], expiration_time: DHTExpiration | None = None, return_future: bool = False
) -> list[RemoteExpert | None] | concurrent.futures.Future:
    """A RemoteExpert for each uid announced in the DHT (None for those not found or expired).

    `expiration_time`: accept only announcements that live at least until then (default: now).
    """

    async def get(dht_, node):
        return await get_experts_async(node, dht_.host, list(uids), expiration_time)

    return dht.run_coroutine(get, return_future=return_future)


def parse_successors(
    prefix: ExpertPrefix, value: object, grid_size: int | None = None
) -> dict[Coordinate, tuple[ExpertUID, PeerID]]:
    """The well-formed entries of a prefix's dictionary: {coordinate: (uid, peer id)}.

    An entry counts when its subkey is a coordinate in [0, grid_size) (or FLAT_EXPERT for a
    one-dimensional uid), and its value is (uid, base58 peer id) with the uid under
    `prefix + coordinate`. Anything else (expired, the negative-cache marker, garbage) is skipped.
    """
    if not isinstance(value, dict):
        return {}
    successors = {}
    for coordinate, entry in value.items():
        if type(coordinate) is not int:
            continue
        if coordinate < -1 or (grid_size is not None and coordinate >= grid_size):
            continue
        item = getattr(entry, "value", None)
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            continue
        uid, peer = item
        if not is_valid_uid(uid):
            continue
        if coordinate == -1:
            if uid + UID_DELIMITER != prefix:
                continue
        elif not (uid == f"{prefix}{coordinate}" or uid.startswith(f"{prefix}{coordinate}{UID_DELIMITER}")):
            continue
        peer_id = _peer_id(peer)
        if peer_id is not None:
            successors[coordinate] = (uid, peer_id)
    return successors
