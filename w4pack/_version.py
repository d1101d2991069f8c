"""The package version, importable without running the package __init__ (runtime, transformers hook)."""
__version__ = "0.1.0"
