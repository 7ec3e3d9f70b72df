"""The dashboard in a real headless Chromium against a local swarm: it lists the peers that report
progress, shows one that joins, and drops one that is killed (SIGKILL: no goodbye, its record goes stale)."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from plexus.dht.dht import DHT
from plexus.optim.progress_tracker import ProgressTracker

pytest.importorskip("aiohttp", reason="the dashboard needs aiohttp: pip install plexus[dashboard]")
webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs selenium")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from plexus.dashboard import Dashboard  # noqa: E402

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs chromium and chromedriver (apt-get install chromium chromium-driver; "
        "scripts/setup_env.sh does it as root)",
    ),
]
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
STALE_AFTER = 3.0

# A trainer in its own process, so that it can be killed for real: it reports progress until killed.
TRAINER = """
import sys, threading
from plexus.dht.dht import DHT
from plexus.optim.progress_tracker import ProgressTracker
dht = DHT(initial_peers=sys.argv[1:], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
tracker = ProgressTracker(dht, "run", 100, min_refresh_period=0.05, max_refresh_period=0.5)
tracker.report_local_progress(0, 7)
print(dht.peer_id, flush=True)
threading.Event().wait()
"""


def start_trainer(initial: DHT, samples: int) -> tuple[DHT, ProgressTracker]:
    dht = DHT(initial_peers=initial.get_visible_maddrs(), start=True, host_maddrs=LOCAL)
    tracker = ProgressTracker(dht, "run", 100, **FAST)
    tracker.report_local_progress(0, samples)
    return dht, tracker


def headless_chromium():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def rows(driver) -> dict[str, str]:
    """peer id -> status, as the page shows them now (read in one go: the page redraws the table)."""
    script = (
        "return Array.from(document.querySelectorAll('#peers tbody tr.peer'))"
        ".map(row => [row.dataset.peerId, row.dataset.status]);"
    )
    return dict(driver.execute_script(script))


def training(driver) -> set[str]:
    return {peer for peer, status in rows(driver).items() if status == "training"}


def test_the_page_follows_the_swarm():
    monitor = DHT(start=True, host_maddrs=LOCAL)
    dashboard = Dashboard(monitor, "run", refresh_period=0.3, stale_after=STALE_AFTER)
    addrs = [str(addr) for addr in monitor.get_visible_maddrs()]
    doomed = subprocess.Popen([sys.executable, "-c", TRAINER, *addrs], stdout=subprocess.PIPE, text=True)
    trainers, driver = [], None
    try:
        trainers.append(start_trainer(monitor, 20))
        driver = headless_chromium()
        driver.get(dashboard.url)
        assert driver.title == "Plexus swarm"
        doomed_id = doomed.stdout.readline().strip()
        assert doomed_id.startswith("12D3KooW"), f"the trainer process did not start: {doomed_id!r}"
        first_id = str(trainers[0][0].peer_id)
        wait = WebDriverWait(driver, 30, poll_frequency=0.2)
        wait.until(lambda d: training(d) == {first_id, doomed_id}, "the two trainers shown")
        assert driver.find_element(By.ID, "trainers").text == "2"
        assert driver.find_element(By.ID, "connection").text == "live"
        assert "run run" in driver.find_element(By.ID, "run-id").text

        trainers.append(start_trainer(monitor, 30))  # a peer joins
        joined_id = str(trainers[1][0].peer_id)
        wait.until(lambda d: training(d) == {first_id, doomed_id, joined_id}, "the newcomer shown")
        wait.until(lambda d: d.find_element(By.ID, "samples").text == "57", "the samples of all three")

        os.kill(doomed.pid, signal.SIGKILL)  # a crash: its last record stays in the DHT until stale
        doomed.wait(10)
        wait.until(lambda d: training(d) == {first_id, joined_id}, "the killed trainer dropped")
        assert rows(driver).get(doomed_id) in (None, "known")  # at most a DHT peer we knew of
        assert driver.find_element(By.ID, "trainers").text == "2"
    finally:
        if driver is not None:
            driver.quit()
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(10)
        dashboard.shutdown()
        for dht, tracker in trainers:
            tracker.shutdown()
            dht.shutdown()
        monitor.shutdown()
