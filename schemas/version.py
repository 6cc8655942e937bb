"""tracejudge's version, at the bottom of the house so that every layer may read it.

The face re-exports it (`tracejudge.__version__`, `tracejudge --version`); the write-back sinks stamp
it on what they write (`tracejudge.version` on MLflow feedback, the OTLP sink's resource and
instrumentation scope). It must equal `version` in pyproject.toml.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
