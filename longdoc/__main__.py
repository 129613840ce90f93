"""`python -m longdoc`: the same command line as the `longdoc` script (longdoc.cli)."""

from longdoc.cli import main

raise SystemExit(main())
