"""`tracejudge demo` and what it embeds: a local Kafka-compatible broker (`broker.py`, also the test
suite's and the benchmarks' broker), a synthetic RAG agent traced with the real MLflow tracing
(`agent.py`, with the causes of a page it can be made to plant; what it knows and is asked in
`corpus.py`), and the command that wires them to the real stream runner (`command.py`): the agent's
producer thread (`producer.py`), the stages run in-process (`embedded.py`) and the live and final
summary read from their Prometheus registries (`summary.py`).

Needs the `tracejudge[demo]` extra (the Tansu broker binary and mlflow-skinny); nothing else in
tracejudge imports this package.
"""
