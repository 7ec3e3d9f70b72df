"""Wait for a condition with a deadline, instead of sleeping a guessed amount of time."""

import time


def wait_until(predicate, timeout: float, interval: float = 0.02, message: str = "condition") -> None:
    """Poll `predicate()` until it is true; raise TimeoutError naming `message` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} did not hold within {timeout} s")
        time.sleep(interval)
