"""The input formats: detection, MLflow traces, OTLP spans and logs, inference-log rows, agent-evaluation
rows, human labels, span conventions and derivation of the record."""
