"""The CP attention strategies, one module each; each registers its own (longdoc.parallel.strategy imports every
module of this folder on the first lookup, so a new strategy is one new file here)."""
