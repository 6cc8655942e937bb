"""The stages on the runtime: run (evaluate traces), decoding, assembly, sessions, sink, agreement and
backfill."""
