"""The judges and the runner that orchestrates them.

The judges: `base` (what every judge builds on: `Judge`, `Job`, answer parsing), `builtin` (the LLM
judges), `heuristic`, `tool_calls`, `custom`, `sessions` (and `heuristic_sessions`); `registry` maps
configured names to them. The runner's parts: `planning` (sampling, filters, shadows), `spending` and
`budget`, `client` and `breaker`, `redaction`, `prompt_safety`, `secrets`, `series` (Prometheus); the
configuration is `config` with `endpoints`. `trust/` holds canaries, shadows and calibration.
"""
