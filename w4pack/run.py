"""Moved to ``w4pack.runtime.run``; this name stays an alias of it (same module object), for old imports."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("w4pack.runtime.run")
