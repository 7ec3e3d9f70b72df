"""Validators: Ed25519-owned records, pydantic schemas, and their composite."""

import pydantic
import pytest

from plexus.dht.crypto import Ed25519SignatureValidator
from plexus.dht.protocol import make_record
from plexus.dht.routing import DHTID
from plexus.dht.schema import BytesWithPublicKey, SchemaValidator
from plexus.dht.validation import CompositeValidator, DHTRecord
from plexus.utils.serializer import MSGPackSerializer as S

pytestmark = pytest.mark.timeout(30)


def record(key, value, expiration=100.0, subkey=None) -> DHTRecord:
    return make_record(
        DHTID.generate(key), None if subkey is None else S.dumps(subkey), S.dumps(value), expiration
    )


def test_owned_record_needs_the_owners_signature():
    alice, mallory = Ed25519SignatureValidator(), Ed25519SignatureValidator()
    plain = record("progress", {"step": 1}, subkey=b"someone")
    assert alice.validate(plain) and alice.sign_value(plain) == plain.value  # not owned: passes as is

    owned = record("progress", {"step": 1}, subkey=alice.local_public_key)
    signed = DHTRecord(owned.key, owned.subkey, alice.sign_value(owned), owned.expiration_time)
    assert signed.value.endswith(b"]") and b"[signature:" in signed.value
    assert alice.validate(signed) and mallory.validate(signed)  # anyone can check it
    assert alice.strip_value(signed) == owned.value
    assert not mallory.validate(owned)  # unsigned
    # mallory signs with her own key: still not alice's signature
    forged = DHTRecord(
        owned.key,
        owned.subkey,
        owned.value
        + mallory.sign_value(
            DHTRecord(owned.key, mallory.local_public_key, owned.value, owned.expiration_time)
        )[len(owned.value) :],
        owned.expiration_time,
    )
    assert not alice.validate(forged)
    # a signature does not carry over to another expiration, key or value
    for changed in (
        DHTRecord(signed.key, signed.subkey, signed.value, signed.expiration_time + 1),
        DHTRecord(DHTID.generate("other").to_bytes(), signed.subkey, signed.value, signed.expiration_time),
        DHTRecord(signed.key, signed.subkey, S.dumps({"step": 2}) + signed.value[len(owned.value) :], 100.0),
    ):
        assert not alice.validate(changed)


def test_two_owners_or_garbage_markers_are_refused():
    alice, bob = Ed25519SignatureValidator(), Ed25519SignatureValidator()
    both = DHTRecord(
        DHTID.generate("k").to_bytes(), alice.local_public_key + bob.local_public_key, b"\x01", 10.0
    )
    assert not alice.validate(DHTRecord(both.key, both.subkey, alice.sign_value(both), 10.0))
    garbage = DHTRecord(both.key, b"[owner:AAAA]", b"\x01[signature:AAAA]", 10.0)
    assert not alice.validate(garbage)
    assert not alice.validate(DHTRecord(both.key, alice.local_public_key, b"\x01[signature:!!]", 10.0))


def test_strip_leaves_unowned_values_alone():
    validator = Ed25519SignatureValidator()
    text = record("k", "looks like [signature:AAAA]")
    assert validator.strip_value(text) == text.value


class Report(pydantic.BaseModel):
    step: int
    loss: float | None = None


class Schema(pydantic.BaseModel):
    progress: dict[BytesWithPublicKey, Report | None]
    name: str
    pair: tuple[int, str]


def test_schema_validator_is_strict():
    validator = SchemaValidator(Schema, allow_extra_keys=False)
    assert validator.validate(record("name", "ok"))
    assert not validator.validate(record("name", 1))
    assert validator.validate(record("pair", (1, "a")))
    assert not validator.validate(record("pair", [1, "a"]))  # no coercion of list to tuple
    assert not validator.validate(record("unknown", 1))
    owner = Ed25519SignatureValidator().local_public_key
    assert validator.validate(record("progress", {"step": 3}, subkey=owner))
    assert validator.validate(record("progress", None, subkey=owner))  # deletion
    assert not validator.validate(record("progress", {"step": "3"}, subkey=owner))
    assert not validator.validate(record("progress", {"step": 3}, subkey=b"not-owned"))
    assert not validator.validate(DHTRecord(DHTID.generate("name").to_bytes(), b"\xc0", b"\xc1", 1.0))
    assert SchemaValidator(Schema).validate(record("unknown", 1))


def test_schema_prefix_and_merge():
    class Other(pydantic.BaseModel):
        name: int

    validator = SchemaValidator(Schema, allow_extra_keys=False, prefix="run1")
    assert validator.validate(record("run1_name", "x")) and not validator.validate(record("name", "x"))
    assert validator.merge_with(SchemaValidator(Other, allow_extra_keys=False, prefix="run1"))
    assert validator.validate(record("run1_name", "x")) and validator.validate(record("run1_name", 5))
    assert not validator.validate(record("run1_name", 5.5))


def test_composite_signs_then_validates_in_priority_order():
    signer = Ed25519SignatureValidator()
    composite = CompositeValidator([SchemaValidator(Schema, allow_extra_keys=False), signer])
    assert [type(v).__name__ for v in composite.validators] == [
        "SchemaValidator",
        "Ed25519SignatureValidator",
    ]
    owned = record("progress", {"step": 1}, subkey=signer.local_public_key)
    signed = DHTRecord(owned.key, owned.subkey, composite.sign_value(owned), owned.expiration_time)
    assert composite.validate(signed)  # the schema sees the value with the signature stripped
    assert composite.strip_value(signed) == owned.value
    assert not composite.validate(owned)
    bad = record("progress", {"step": "x"}, subkey=signer.local_public_key)
    assert not composite.validate(DHTRecord(bad.key, bad.subkey, composite.sign_value(bad), 100.0))


def test_composite_merges_validators_of_one_kind():
    class A(pydantic.BaseModel):
        a: int

    class B(pydantic.BaseModel):
        b: int

    composite = CompositeValidator([SchemaValidator(A, allow_extra_keys=False)])
    composite.extend([SchemaValidator(B, allow_extra_keys=False)])
    assert len(composite) == 1
    assert composite.validate(record("a", 1)) and composite.validate(record("b", 1))


def test_crashing_validator_counts_as_refusal():
    class Broken(SchemaValidator):
        def validate(self, record):
            raise RuntimeError("boom")

    assert not CompositeValidator([Broken(Schema)]).validate(record("name", "x"))


def test_protected_key_rejects_plain_values_and_extra_owner_subkeys():
    from plexus.dht.schema import OwnerPublicKey

    class Protected(pydantic.BaseModel):
        progress: dict[BytesWithPublicKey, int | None]
        single: dict[OwnerPublicKey, int | None]
        open_dict: dict[bytes, int]

    validator = SchemaValidator(Protected, allow_extra_keys=False)
    owner = Ed25519SignatureValidator().local_public_key
    assert validator.validate(record("progress", 1, subkey=owner))
    assert not validator.validate(record("progress", {})), "a plain value would shadow the signed entries"
    assert not validator.validate(record("progress", None))
    assert validator.validate(record("single", 1, subkey=owner))
    assert not validator.validate(record("single", 1, subkey=owner + b"2")), "one sub-key per owner"
    assert not validator.validate(record("single", {}))
    assert validator.validate(record("open_dict", {b"a": 1})), "unprotected dictionaries keep plain values"
