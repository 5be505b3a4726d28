"""The package version (pyproject.toml holds the same): a leaf, so that the modules that record it
in their results import nothing above them."""

__version__ = "0.1.0"
