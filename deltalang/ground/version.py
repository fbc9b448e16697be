"""deltalang's version: one home, read by the package face, the emitted code's docstring and results.json."""

__version__ = "0.1.0"
