"""Write-back sinks: verdicts onto traces in MLflow and OpenTelemetry backends."""
