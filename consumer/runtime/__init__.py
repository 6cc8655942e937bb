"""The Kafka runtime every stage runs on: the consumer loop, offsets, producing and dead letters, the HTTP
endpoint, logging and process set-up."""
