"""tracejudge: evaluate LLM agent traces — offline, in tests, and live from Kafka — with one code path."""

__version__ = "0.1.0"
