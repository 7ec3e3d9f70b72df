"""Record validators: who may write what into the DHT, checked by every node that stores or reads.

A validator sees a `DHTRecord` in its wire form (key = the 20-byte DHTID, subkey = msgpack of the
user's subkey or of None, value = serialized bytes with whatever the validators appended). It can
refuse it (`validate`), add proof before sending (`sign_value`), and remove that proof again so the
next validator and the user see the plain value (`strip_value`).

Several validators form a `CompositeValidator`: it signs in ascending priority (so the
highest-priority validator, the signature, wraps everything) and validates/strips in descending
priority (peeling those layers off in reverse). Validators of one kind may `merge_with` each other
so that adding, say, a second schema extends the first instead of requiring both to accept.
"""

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class DHTRecord:
    key: bytes
    subkey: bytes
    value: bytes
    expiration_time: float


class RecordValidatorBase(ABC):
    """A rule every record must pass before a node stores or returns it, and the proof the rule
    adds to the values this node sends (a signature, say). A `CompositeValidator` applies several,
    ordered by `priority`."""

    @abstractmethod
    def validate(self, record: DHTRecord) -> bool:
        """True if the record may be stored or returned; must not raise on malformed input."""

    def sign_value(self, record: DHTRecord) -> bytes:
        """The value to send, with any proof this validator adds (default: unchanged)."""
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        """The value without this validator's proof (default: unchanged)."""
        return record.value

    @property
    def priority(self) -> int:
        """Higher priority signs last and validates first."""
        return 0

    def merge_with(self, other: "RecordValidatorBase") -> bool:
        """Absorb `other` into self if they are of one kind; True when merged (other is then dropped)."""
        return False


class CompositeValidator(RecordValidatorBase):
    """Several validators acting as one; a record must pass all of them."""

    def __init__(self, validators: Iterable[RecordValidatorBase] = ()):
        self._validators: list[RecordValidatorBase] = []
        self.extend(validators)

    def extend(self, validators: Iterable[RecordValidatorBase]) -> None:
        for new_validator in validators:
            if isinstance(new_validator, CompositeValidator):
                self.extend(new_validator._validators)
                continue
            if not any(existing.merge_with(new_validator) for existing in self._validators):
                self._validators.append(new_validator)
        self._validators.sort(key=lambda validator: validator.priority)

    def validate(self, record: DHTRecord) -> bool:
        for validator in reversed(self._validators):
            try:
                if not validator.validate(record):
                    return False
                record = dataclasses.replace(record, value=validator.strip_value(record))
            except Exception:  # a validator that crashes on hostile input counts as a refusal
                return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        for validator in self._validators:
            record = dataclasses.replace(record, value=validator.sign_value(record))
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        for validator in reversed(self._validators):
            record = dataclasses.replace(record, value=validator.strip_value(record))
        return record.value

    @property
    def validators(self) -> tuple[RecordValidatorBase, ...]:
        return tuple(self._validators)

    def __len__(self) -> int:
        return len(self._validators)
