"""Fetch the Go libp2p daemon (p2pd) used as an interoperability test fixture.

It ships inside the `hivemind` wheel on PyPI; we download that wheel without dependencies and
unpack only the binary into .cache/p2pd/. Plexus never depends on it at run time.
"""

import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_SPEC = "hivemind==1.1.12"
MEMBER = "hivemind/hivemind_cli/p2pd"
TARGET = Path(__file__).resolve().parent.parent / ".cache" / "p2pd" / "p2pd"


def main() -> int:
    if TARGET.exists():
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL_SPEC]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"could not download {WHEEL_SPEC} for the p2pd fixture:\n{result.stderr}", file=sys.stderr)
            return 0 if os.environ.get("CI") != "true" else 1
        (wheel,) = Path(tmp).glob("hivemind-*.whl")
        with zipfile.ZipFile(wheel) as archive, open(TARGET, "wb") as out:
            out.write(archive.read(MEMBER))
    TARGET.chmod(TARGET.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    print(f"p2pd fixture ready at {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
