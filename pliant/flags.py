"""Command-line flags the pliant commands share the rules of: no abbreviations, and defaults read from the
environment whose bad values are reported, like a bad flag's, naming the variable.

- :func:`add_tls_flags` and :func:`tls_from_flags`: ``--tls-dir`` and ``--insecure``, the flags of every command that
  calls or serves gRPC.
- :class:`Parser` is every pliant command's parser (its subcommands' too): ``allow_abbrev=False``, so that
  ``--nproc-per-nod 2`` is an error instead of silently meaning ``--nproc-per-node``, and an error is one line.
- A flag whose default a variable sets (:meth:`pliant.settings.Setting.flag_default`) gets it as an
  :class:`pliant.settings.EnvValue`, read when the parser is built but converted only when the command line is parsed
  (argparse
  converts a string default with the flag's ``type``), so a bad value never breaks ``--help`` or another command;
  :func:`typed` is that ``type``, whose error names the variable when the value came from it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from pliant import settings
from pliant.errors import ConfigError
from pliant.security.tlsdir import TlsConfig
from pliant.settings import EnvValue

__all__ = ["Parser", "add_tls_flags", "tls_from_flags", "typed"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Parser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviated flag, and says what is wrong in one line (the usage is what
    ``--help`` is for); its subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def typed(convert: Callable[[str], _T], what: str) -> Callable[[str], _T]:
    """A flag's ``type``: ``convert``, with an error that says the value is not ``what`` (e.g. "an integer") and, for
    a value from the environment, names the variable to fix."""

    def parse(text: str) -> _T:
        try:
            return convert(text)
        except ValueError:
            if isinstance(text, EnvValue):
                raise argparse.ArgumentTypeError(
                    f"{text.var}={text!r} (from the environment) is not {what}; set it to {what} or unset it"
                ) from None
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None

    parse.__name__ = what  # what argparse says of a value it could not convert without this error
    return parse


def add_tls_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """Add ``--tls-dir`` (env ``PLIANT_TLS_DIR``) and ``--insecure`` to a command run as ``role``."""
    parser.add_argument(
        "--tls-dir",
        default=settings.TLS_DIR.flag_default(),
        help=f"directory with ca.crt, tls.crt and tls.key of a{'n' if role[0] in 'aeiou' else ''} {role} certificate "
        f"(env PLIANT_TLS_DIR; create them with `pliant certs`)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC without certificates: anyone who reaches the coordinator can do anything (not for "
        "shared networks)",
    )


def tls_from_flags(tls_dir: str | None, insecure: bool, command: str) -> TlsConfig | None:
    """The TLS files named by ``--tls-dir``, or None with ``--insecure`` (logged as a warning).

    Raises:
        ConfigError: neither or both were given, or the directory does not exist.
    """
    if tls_dir and insecure:
        raise ConfigError("--tls-dir (or PLIANT_TLS_DIR) and --insecure contradict each other; drop one")
    if insecure:
        logger.warning("%s --insecure: gRPC in plaintext, no certificates checked", command)
        return None
    if not tls_dir:
        raise ConfigError(
            f"TLS is required for `pliant {command}`: pass --tls-dir DIR (or set PLIANT_TLS_DIR) with ca.crt, tls.crt "
            f"and tls.key (create them with `pliant certs`), or --insecure for plaintext"
        )
    return TlsConfig.from_dir(tls_dir)
