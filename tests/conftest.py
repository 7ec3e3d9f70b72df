from tests.p2pd import p2pd_factory  # noqa: F401  (the Go libp2p daemon as an interop fixture)
