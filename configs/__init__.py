"""ml-collections configs: one experiment per file, shared pieces in common.py."""
