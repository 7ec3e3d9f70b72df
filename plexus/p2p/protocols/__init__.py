"""Sans-I/O cores of the wire protocols: bytes in, events and bytes out; no asyncio, sockets or clocks."""
