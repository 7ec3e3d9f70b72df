"""The WAN lab: Plexus peers (or any program) on emulated internet links, on one Linux machine."""

from .lab import LabOptions, WanLab
from .profiles import PROFILES, LinkProfile, PathModel

__all__ = ["PROFILES", "LabOptions", "LinkProfile", "PathModel", "WanLab"]
