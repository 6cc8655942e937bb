"""The judges: built-in, heuristic, custom, tool-call and session judges, their prompts, the client,
redaction, budgets, sampling and the runner that orchestrates them."""
