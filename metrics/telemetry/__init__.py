"""Every Prometheus family tracejudge exports, and the export of one result."""
