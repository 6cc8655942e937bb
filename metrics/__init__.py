"""What is measured: computed metrics, judges, and their Prometheus export."""
