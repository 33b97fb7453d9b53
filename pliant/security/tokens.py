"""Join tokens as an operator hands them to a command: read from a file (``--join-token-file``), never from a
command line other users can read."""

from __future__ import annotations

from pathlib import Path

from pliant.errors import ConfigError

__all__ = ["read_token_file"]


def read_token_file(path: str) -> str:
    """The join token in ``path`` (surrounding whitespace removed).

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"join token file {path} cannot be read ({exc.strerror}); check the path") from exc
    if not token:
        raise ConfigError(
            f"join token file {path} is empty; write the job's token into it (pliant job create --write-token {path})"
        )
    return token
