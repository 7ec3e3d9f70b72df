"""Skipping (or, under CI, failing) tests that need to build network namespaces."""

import os

import pytest

from plexus.testing.netns import missing_prerequisite


def require_lab(tools=("ip", "nft")) -> None:
    """Skip unless this machine can build namespaces with `tools`; CI=true must run them, so fails."""
    reason = missing_prerequisite(tools)
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} -- CI must run the network namespace tests", pytrace=False)
        pytest.skip(reason)
