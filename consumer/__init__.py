"""The runtime: sources (Kafka, files), trace assembly, sampling, the pipeline, commits, CLI."""
