"""The Kafka runtime every stage runs on: the consumer loop (`loop`), the `Stage` interface (`stage`),
offsets and work in flight (`offsets`), the producer every stage's results and dead letters leave
through (`producer`, with the publishers in `producing`), the HTTP endpoint (`http`), logging
(`logs`) and a stage's process: signals, entry point, shared flags (`process`, `arguments`)."""
