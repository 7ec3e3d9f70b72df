"""Logs as hivemind users expect them: `verbose=True` shows the status lines in a script that set up no
logging, PLEXUS_LOGLEVEL is honoured, an ETA without a speed reads "unknown", repeats are squashed."""

import io
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from plexus.utils.logging import eta_text, remove_plexus_log_handler, use_plexus_log_handler

pytestmark = pytest.mark.timeout(120)

OPTIMIZER_SCRIPT = """
import time
import functools
import torch, plexus
{setup}
dht = plexus.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
model = torch.nn.Linear(2, 1)
opt = plexus.Optimizer(
    dht=dht, run_id="logs", target_batch_size=64, batch_size_per_step=4,
    optimizer=functools.partial(torch.optim.SGD, lr=0.1), params=model.parameters(), verbose=True,
)
deadline = time.monotonic() + 60
while opt.tracker.fetch_count < 1 and time.monotonic() < deadline:
    time.sleep(0.05)  # polling a condition under a deadline
assert opt.tracker.fetch_count >= 1, "the progress tracker never fetched"
opt.shutdown()
dht.shutdown()
"""


def run_script(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PLEXUS_LOGLEVEL"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=100,
        env={**environment, **env},
    )


def test_verbose_optimizer_shows_its_status_lines_in_a_bare_script_with_an_unknown_eta():
    result = run_script(OPTIMIZER_SCRIPT.format(setup=""))
    assert result.returncode == 0, result.stderr
    status = [line for line in result.stderr.splitlines() if "accumulated" in line and "[INFO]" in line]
    assert status, result.stderr
    assert "ETA unknown" in status[0], status[0]  # no samples/s measured yet: no absurd number
    assert "Traceback" not in result.stderr


def test_an_application_that_configured_logging_keeps_its_own_choice():
    setup = "import logging; logging.basicConfig(level=logging.WARNING)"
    result = run_script(OPTIMIZER_SCRIPT.format(setup=setup))
    assert result.returncode == 0, result.stderr
    assert "[INFO]" not in result.stderr and "accumulated" not in result.stderr, result.stderr


def test_plexus_loglevel_is_honoured_in_a_bare_script():
    code = """
        import plexus
        dht = plexus.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dht.shutdown()
    """
    assert "[DEBUG]" in run_script(code, PLEXUS_LOGLEVEL="DEBUG").stderr
    quiet = run_script(code, PLEXUS_LOGLEVEL="ERROR")
    assert quiet.returncode == 0 and "[INFO]" not in quiet.stderr and "[DEBUG]" not in quiet.stderr


@pytest.mark.timeout(5)
def test_eta_text_says_unknown_rather_than_an_absurd_time():
    assert eta_text(12.345) == "12.35 sec"
    assert eta_text(-3.0) == "0.00 sec"
    for absurd in (1e12, float("inf"), float("nan")):
        assert eta_text(absurd) == "unknown"


@pytest.mark.timeout(5)
def test_identical_lines_in_a_row_are_written_once_then_counted():
    stream, name = io.StringIO(), "plexus_test_repeats"
    use_plexus_log_handler("INFO", stream=stream, logger_name=name)
    try:
        logger = logging.getLogger(name)
        for _ in range(3):
            logger.info("peer is out of sync")
        logger.warning("peer is out of sync")  # another level: another line
        logger.info("caught up")
        logger.info("caught up")
    finally:
        remove_plexus_log_handler(name)
    lines = [line.split("] ", 2)[-1] for line in stream.getvalue().splitlines()]
    assert lines == [
        "peer is out of sync",
        "(the line above was repeated 2 more times)",
        "peer is out of sync",
        "caught up",
    ], lines
