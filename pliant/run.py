"""``python -m pliant.run [flags] SCRIPT [ARGS...]``: the same as ``pliant run``, like torchrun's module form."""

import sys

from pliant.cli import main

raise SystemExit(main(["run", *sys.argv[1:]]))
