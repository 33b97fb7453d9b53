"""The root of pliant's error hierarchy; each subsystem derives its own base from :class:`PliantError`."""

from __future__ import annotations

__all__ = ["ConfigError", "PliantError"]


class PliantError(Exception):
    """Base of every error pliant raises on purpose. Messages name the bad value and the fix."""


class ConfigError(PliantError, ValueError):
    """A configuration value or command-line flag is invalid."""
