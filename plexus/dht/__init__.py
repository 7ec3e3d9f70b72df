"""A Kademlia DHT with expiring, signed and schema-checked records. Names load on first use.

`DHT` is the synchronous peer most code needs; `DHTNode` the asyncio participant under it.
"""

from typing import Any

from ..utils.exports import lazy_exports

DHTValue = Any
"""What a DHT record may hold: anything MSGPackSerializer packs (built-in types, tuples kept)."""

_EXPORTS = {
    "DHT": ".dht",
    "DHTNode": ".node",
    "DHTBootstrapError": ".node",
    "DHTID": ".routing",
    "DHTRecord": ".validation",
    "RecordValidatorBase": ".validation",
    "CompositeValidator": ".validation",
    "SignatureValidator": ".crypto",
    "Ed25519SignatureValidator": ".crypto",
    "RSASignatureValidator": ".rsa",
    "RSAPrivateKey": ".rsa",
    "SchemaValidator": ".schema",
    "BytesWithPublicKey": ".schema",
    "DictionaryDHTValue": ".storage",
}
__all__ = ["DHTValue", *list(_EXPORTS)]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
