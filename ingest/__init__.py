"""Ingest: Kafka records -> validated events or dead letters -> the store, exactly once.

`consumer` is the live consumer-group member, `replay` re-feeds history, `decode` is the pure
bytes -> event function both share, `ndjson` reads and writes the file format.
"""
