#!/bin/bash
# Create tracejudge's topics once Kafka is up (idempotent). $TOPICS, $PARTITIONS, $BOOTSTRAP from compose.
set -euo pipefail
for topic in ${TOPICS}; do
  /opt/kafka/bin/kafka-topics.sh --bootstrap-server "${BOOTSTRAP}" --create --if-not-exists \
    --topic "${topic}" --partitions "${PARTITIONS}" --replication-factor 1
done
/opt/kafka/bin/kafka-topics.sh --bootstrap-server "${BOOTSTRAP}" --list
