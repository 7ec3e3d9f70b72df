"""What hivemind code imports from `hivemind.proto.runtime_pb2`: the `CompressionType` enum.

Plexus has no protobuf messages of its own (its wire formats are msgpack); the enum is
`plexus.compression.CompressionType`, with hivemind's values and protobuf-enum helpers.
"""

from ..compression.wire import CompressionType

__all__ = ["CompressionType"]
