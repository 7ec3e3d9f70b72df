__version__ = "0.1.0"
"""This release of Plexus (also the package's version in pyproject.toml)."""
