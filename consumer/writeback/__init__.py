"""The documented import path of the `Sink` plug-in interface, kept for plug-ins written against it: the
sinks live in `tracejudge.consumer.sinks`."""
