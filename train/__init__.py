"""train stage (see DESIGN.md). Talks to other stages only through the store and pipeline.core.types."""
