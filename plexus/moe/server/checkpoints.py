"""Expert checkpoints on disk: `<dir>/<uid>/checkpoint_<UTC time>.pt`, plus `checkpoint_last.pt`.

Each file holds one backend's `state_dict()` (module, optimizer, scheduler). A file is written
under a temporary name in the same directory and renamed into place, so a crash leaves either the
old checkpoint or the new one, never half of one. `checkpoint_last.pt` is a symlink to the newest
file (swapped atomically the same way), or a copy where symlinks are not available. Only the
newest `keep_last` timestamped files are kept, so the disk does not fill up over a long run.

Loading uses `torch.load(weights_only=True)`: a checkpoint is data, never code to run.
"""

from __future__ import annotations

import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch

from ...utils.logging import get_logger
from .module_backend import ModuleBackend

logger = get_logger(__name__)

LAST = "checkpoint_last.pt"
DEFAULT_KEEP_LAST = 5


def _checked_dir(checkpoint_dir: Path, uid: str) -> Path:
    if not uid or uid in (".", "..") or "/" in uid or "\\" in uid or "\0" in uid:
        raise ValueError(f"expert uid {uid!r} cannot name a checkpoint directory")
    return Path(checkpoint_dir) / uid


def _atomic_write(path: Path, write) -> None:
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _point_last(expert_dir: Path, target: Path) -> None:
    last = expert_dir / LAST
    temp = expert_dir / f".{LAST}.{os.getpid()}.tmp"
    try:
        temp.unlink(missing_ok=True)
        os.symlink(target.name, temp)
        os.replace(temp, last)
    except OSError:  # no symlinks here (some Windows set-ups): keep a copy instead
        temp.unlink(missing_ok=True)
        _atomic_write(last, lambda file: file.write(target.read_bytes()))


def save_expert(backend: ModuleBackend, checkpoint_dir: Path, keep_last: int = DEFAULT_KEEP_LAST) -> Path:
    """Write one checkpoint of `backend` and point checkpoint_last.pt at it; returns its path."""
    expert_dir = _checked_dir(checkpoint_dir, backend.name)
    expert_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    path = expert_dir / f"checkpoint_{stamp}.pt"
    state = backend.state_dict()
    _atomic_write(path, lambda file: torch.save(state, file))
    _point_last(expert_dir, path)
    old = sorted(p for p in expert_dir.glob("checkpoint_*.pt") if p.name != LAST and not p.is_symlink())
    for stale in old[:-keep_last] if keep_last > 0 else []:
        stale.unlink(missing_ok=True)
    return path


def store_experts(
    experts: dict[str, ModuleBackend], checkpoint_dir: Path, keep_last: int = DEFAULT_KEEP_LAST
) -> None:
    """Checkpoint every expert (call it where no batch is running, e.g. through Runtime.submit_job)."""
    for backend in experts.values():
        save_expert(backend, checkpoint_dir, keep_last)


def load_experts(experts: dict[str, ModuleBackend], checkpoint_dir: Path) -> list[str]:
    """Restore each expert that has a checkpoint_last.pt; returns the uids restored."""
    restored = []
    for uid, backend in experts.items():
        last = _checked_dir(checkpoint_dir, uid) / LAST
        if not last.exists():
            continue
        try:
            state = torch.load(last, map_location="cpu", weights_only=True)
            backend.load_state_dict(state)
        except Exception as error:
            raise RuntimeError(
                f"could not restore expert {uid!r} from {last.resolve()}: {error}. Move the file "
                f"away to start this expert afresh"
            ) from error
        restored.append(uid)
    if restored:
        logger.info(f"restored {len(restored)} experts from {checkpoint_dir}")
    return restored


def saved_expert_uids(checkpoint_dir: Path) -> list[str]:
    """The uids that have a checkpoint_last.pt under `checkpoint_dir`."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    return sorted(entry.name for entry in root.iterdir() if (entry / LAST).exists())
