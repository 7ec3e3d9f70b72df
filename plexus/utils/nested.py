"""Nested structures of lists, tuples, namedtuples and dicts, flattened to their leaves and back.

Dictionaries are walked in sorted key order, so a structure and its copy flatten the same way on
every peer. `nested_pack(nested_flatten(x), x)` rebuilds `x`.
"""

from collections.abc import Callable, Iterable, Iterator
from typing import Any


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple)


def nested_flatten(structure: Any) -> Iterator[Any]:
    """The leaves of `structure`, depth first (dict entries by sorted key)."""
    if isinstance(structure, (list, tuple)):
        for item in structure:
            yield from nested_flatten(item)
    elif isinstance(structure, dict):
        for key in sorted(structure):
            yield from nested_flatten(structure[key])
    else:
        yield structure


def nested_pack(flat: Iterable[Any], structure: Any) -> Any:
    """A structure shaped like `structure` whose leaves are taken from `flat`, in order."""
    leaves = iter(flat)

    def build(template: Any) -> Any:
        if _is_namedtuple(template):
            return type(template)(*(build(item) for item in template))
        if isinstance(template, (list, tuple)):
            return type(template)(build(item) for item in template)
        if isinstance(template, dict):
            return {key: build(template[key]) for key in sorted(template)}
        try:
            return next(leaves)
        except StopIteration:
            raise ValueError("nested_pack: fewer leaves than the structure needs") from None

    return build(structure)


def nested_map(fn: Callable[..., Any], *structures: Any) -> Any:
    """`fn` applied leaf by leaf across structures of the same shape; the result has that shape."""
    if not structures:
        raise ValueError("nested_map needs at least one structure")
    columns = [list(nested_flatten(structure)) for structure in structures]
    if len({len(column) for column in columns}) != 1:
        raise ValueError("nested_map: the structures have different numbers of leaves")
    return nested_pack((fn(*leaves) for leaves in zip(*columns)), structures[0])
