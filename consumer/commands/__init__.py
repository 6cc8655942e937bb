"""The `tracejudge` command and the offline commands (`eval`, `calibrate`)."""
