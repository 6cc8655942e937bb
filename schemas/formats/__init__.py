"""The input formats, read into the nouns: detection (`detect`), MLflow traces (`mlflow`, the general
reader; `mlflow_wire`, the msgspec hot path; `mlflow_rules`, what both share), OTLP spans and logs
(`otlp`, `otlp_logs`, `otlp_common`), inference-log rows, agent-evaluation rows, human labels
(`labels`), input files as users have them (`input_files`), the pydantic input schemas (`inputs`),
span conventions (`conventions`, `attribute_values`, `session_identity`, `model_cost`) and derivation
of the record (`derive`, `derive_text`, `derive_usage`)."""
