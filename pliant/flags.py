"""Command-line flags the pliant commands share the rules of: no abbreviations, and defaults read from the
environment whose bad values are reported, like a bad flag's, naming the variable.

- :class:`Parser` is every pliant command's parser (its subcommands' too): ``allow_abbrev=False``, so that
  ``--nproc-per-nod 2`` is an error instead of silently meaning ``--nproc-per-node``, and an error is one line.
- A flag whose default a variable sets (:meth:`pliant.settings.Setting.flag_default`) gets it as an
  :class:`EnvValue`, read when the parser is built but converted only when the command line is parsed (argparse
  converts a string default with the flag's ``type``), so a bad value never breaks ``--help`` or another command;
  :func:`typed` is that ``type``, whose error names the variable when the value came from it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

__all__ = ["EnvValue", "Parser", "typed"]

_T = TypeVar("_T")


class Parser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviated flag, and says what is wrong in one line (the usage is what
    ``--help`` is for); its subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class EnvValue(str):
    """A flag's default as the environment variable :attr:`var` gave it."""

    var: str


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
