"""Experiments run on the product: each sub-package holds one, with its config, code and results."""
