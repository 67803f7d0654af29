from importlib.metadata import version as _v
