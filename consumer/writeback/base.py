"""Re-export of `tracejudge.consumer.sinks.base` at its documented plug-in path."""

from tracejudge.consumer.sinks.base import *  # noqa: F403
from tracejudge.consumer.sinks.base import __all__  # noqa: F401
