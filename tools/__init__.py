"""Development tools, run from a checkout by the Makefile (`make lock`: tools/lockfile.py); not part of the wheel."""
