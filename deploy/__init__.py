"""deploy stage (see docs/architecture.md). Talks to other stages only through the store and pipeline.core.types."""
