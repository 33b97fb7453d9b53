"""pliant: an elastic training runtime for PyTorch.

The core package is thin: the CLI entry point, the error base, logging set-up, small network helpers and the
generated protobuf stubs (``pliant.v1``). The roles live in ``pliant.coordinator``, ``pliant.agent`` and
``pliant.worker``.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
