#!/usr/bin/env python3
"""Take docs/images/dashboard.png: the dashboard of a small local swarm, in headless Chromium.

    python scripts/screenshot_dashboard.py [--out docs/images/dashboard.png] [--seconds 40]

The swarm runs on 127.0.0.1 in this process: a monitor node serving the dashboard, three trainers
and one client-mode trainer, each with its own DHT and progress tracker. They fit a toy linear
regression (each its own copy; the script steps them together when their samples reach the target
batch, standing in for `plexus.Optimizer`), and the mean loss of each global step goes to the
dashboard's loss curve as the ALBERT monitor's steps do. Needs torch, aiohttp, selenium, chromium.
"""

import argparse
import os
import shutil
import time

import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from plexus.dashboard import Dashboard
from plexus.dht.dht import DHT
from plexus.optim.progress_tracker import ProgressTracker
from plexus.utils.timing import get_dht_time

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
TARGET_BATCH_SIZE = 512
FAST = dict(min_refresh_period=0.1, max_refresh_period=1.0, default_refresh_period=0.3)


class ToyTrainer:
    """A peer that fits y = Xw + noise with SGD and reports its samples to the swarm."""

    def __init__(self, initial: DHT, batch_size: int, client_mode: bool, seed: int):
        self.dht = DHT(
            initial_peers=initial.get_visible_maddrs(), start=True, host_maddrs=LOCAL, client_mode=client_mode
        )
        self.tracker = ProgressTracker(self.dht, "demo", TARGET_BATCH_SIZE, **FAST)
        self.batch_size, self.generator = batch_size, torch.Generator().manual_seed(seed)
        self.true_weights = torch.linspace(-1, 1, 16)
        self.model = torch.nn.Linear(16, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.002)
        self.epoch, self.samples, self.losses = 0, 0, []

    def train_one_batch(self) -> None:
        inputs = torch.randn(self.batch_size, 16, generator=self.generator)
        targets = inputs @ self.true_weights + 0.1 * torch.randn(self.batch_size, generator=self.generator)
        loss = torch.nn.functional.mse_loss(self.model(inputs).squeeze(-1), targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.samples += self.batch_size
        self.losses.append(loss.item())
        self.tracker.report_local_progress(self.epoch, self.samples)

    def next_epoch(self) -> None:
        self.epoch, self.samples, self.losses = self.epoch + 1, 0, []
        self.tracker.update_epoch(self.epoch)

    def shutdown(self) -> None:
        self.tracker.shutdown()
        self.dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="docs/images/dashboard.png")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long the swarm trains first")
    args = parser.parse_args()

    monitor = DHT(start=True, host_maddrs=LOCAL)
    dashboard = Dashboard(monitor, "demo", refresh_period=0.5, target_batch_size=TARGET_BATCH_SIZE)
    trainers = [
        ToyTrainer(monitor, batch_size, client_mode, seed)
        for seed, (batch_size, client_mode) in enumerate([(8, False), (6, False), (4, False), (3, True)])
    ]
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(dashboard.url)
        step, deadline = 0, time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            for trainer in trainers:
                trainer.train_one_batch()
            if sum(trainer.samples for trainer in trainers) >= TARGET_BATCH_SIZE:
                step += 1
                losses = [loss for trainer in trainers for loss in trainer.losses]
                speed = sum(trainer.tracker.performance_ema.samples_per_second for trainer in trainers)
                dashboard.record_step(step, sum(losses) / len(losses), speed, get_dht_time())
                for trainer in trainers:
                    trainer.next_epoch()
            time.sleep(0.05)  # pace the toy swarm so that the charts show a few minutes' worth of history
        time.sleep(2.0)  # let the page poll once more after the last step
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        driver.save_screenshot(args.out)
        print(f"saved {args.out} after {step} global steps")
    finally:
        driver.quit()
        dashboard.shutdown()
        for trainer in trainers:
            trainer.shutdown()
        monitor.shutdown()


if __name__ == "__main__":
    main()
