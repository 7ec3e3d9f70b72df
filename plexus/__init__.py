"""Plexus: train one neural network together over the internet, with no master node."""

__version__ = "0.1.0"
