"""Signed and schema-checked records the hivemind way: RSA keys and validators, progress records
signed with a given key, and pydantic v1 schemas."""

import asyncio
import dataclasses
import pickle

import pydantic
import pydantic.v1
import pytest
from hivemind import DHT
from hivemind.dht import DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

pytestmark = pytest.mark.timeout(60)


def test_rsa_validator_signs_its_own_records_and_refuses_forgeries():
    receiver, sender, mallory = (
        RSASignatureValidator(),
        RSASignatureValidator(RSAPrivateKey()),
        RSASignatureValidator(RSAPrivateKey()),
    )
    assert RSASignatureValidator().local_public_key == receiver.local_public_key  # the process-wide key
    assert sender.local_public_key.startswith(b"[owner:ssh-rsa ")
    plain = DHTRecord(b"key", b"subkey", b"value", get_dht_time() + 10)
    assert sender.sign_value(plain) == b"value" and receiver.validate(plain)
    for owned in (
        dataclasses.replace(plain, key=b"key" + sender.local_public_key),
        dataclasses.replace(plain, subkey=b"subkey" + sender.local_public_key),
    ):
        signed = dataclasses.replace(owned, value=sender.sign_value(owned))
        assert receiver.validate(signed) and receiver.strip_value(signed) == b"value"
        for forged in (
            owned,
            dataclasses.replace(owned, value=b"value[signature:INVALID]"),
            dataclasses.replace(owned, value=mallory.sign_value(owned)),
            dataclasses.replace(signed, expiration_time=signed.expiration_time + 1),
        ):
            assert not receiver.validate(forged)
    copy = pickle.loads(pickle.dumps(sender))  # validators travel between processes with their key
    owned = dataclasses.replace(plain, subkey=sender.local_public_key)
    assert receiver.validate(dataclasses.replace(owned, value=copy.sign_value(owned)))


def test_progress_records_are_signed_with_the_given_rsa_key():
    dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    key = RSAPrivateKey()
    tracker = ProgressTracker(dht, "rsa_run", target_batch_size=100, private_key=key, start=True)
    try:
        tracker.report_local_progress(0, 10)
        subkey = RSASignatureValidator(key).local_public_key
        record = dht.get("rsa_run_progress", latest=True)
        assert record is not None and subkey in record.value, "the record is filed under the RSA owner"
        forger = DHT(start=True, initial_peers=dht.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            assert not forger.store("rsa_run_progress", None, get_dht_time() + 30, subkey=subkey)
        finally:
            forger.shutdown()
    finally:
        tracker.shutdown()
        dht.shutdown()
    other = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    default = ProgressTracker(other, "ed_run", target_batch_size=100, start=True)  # Ed25519 stays the default
    try:
        assert b"ssh-rsa" not in default._subkey
    finally:
        default.shutdown()
        other.shutdown()


class SampleSchemaV1(pydantic.v1.BaseModel):
    experiment_name: bytes
    n_batches: dict[bytes, pydantic.v1.conint(ge=0, strict=True)]
    signed_data: dict[BytesWithPublicKey, bytes]


class SampleSchemaV2(pydantic.BaseModel):
    experiment_name: bytes
    n_batches: dict[bytes, pydantic.conint(ge=0, strict=True)]
    signed_data: dict[BytesWithPublicKey, bytes]


@pytest.mark.parametrize("schema", [SampleSchemaV1, SampleSchemaV2], ids=["pydantic.v1", "pydantic.v2"])
def test_schema_validator_takes_v1_and_v2_models(schema):
    owner = RSASignatureValidator().local_public_key

    async def main():
        validator = SchemaValidator(schema)
        alice = await DHTNode.create(record_validator=validator)
        bob = await DHTNode.create(record_validator=validator, initial_peers=await alice.get_visible_maddrs())
        now = get_dht_time()
        assert await bob.store("experiment_name", b"foo", now + 10)
        for value, subkey in ((666, None), ("foo", None), ([1, 2], None), (b"foo", b"subkey")):
            assert not await bob.store("experiment_name", value, now + 10, subkey=subkey)
        assert await bob.store("n_batches", 777, now + 10, subkey=b"uid1")
        for value, subkey in (
            (-1, b"uid2"),
            (779.0, b"uid2"),
            (b"x", b"uid2"),
            (5, None),
            ({b"uid2": 5}, None),
        ):
            assert not await bob.store("n_batches", value, now + 10, subkey=subkey)
        assert await bob.store("signed_data", b"data", now + 10, subkey=b"uid" + owner)
        assert not await bob.store("signed_data", b"data", now + 10, subkey=b"uid-without-an-owner")
        assert (await alice.get("n_batches", latest=True)).value[b"uid1"].value == 777
        await asyncio.gather(alice.shutdown(), bob.shutdown())

    asyncio.run(main())


def test_an_unpickled_rsa_key_must_be_an_rsa_key():
    # A pickled key is a DER blob; one of another kind (here Ed25519) is refused, not half-loaded.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    other = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key = pickle.loads(pickle.dumps(RSAPrivateKey()))
    with pytest.raises(TypeError, match="not an RSA private key"):
        key.__setstate__({"key": other})
