"""``python -m pliant`` runs the same CLI as the ``pliant`` console script."""

from pliant.cli import main

raise SystemExit(main())
