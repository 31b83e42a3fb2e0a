"""The store: tables (the schema source), engines and migrations, and the queries stages use.

Imports no torch, transformers, peft, mlflow or kafka: everything may depend on it.
"""

from pipeline.core.store.db import (
    SchemaError,
    StoreAccessError,
    make_engine,
    require_current_schema,
    store_failure,
    upgrade,
)

__all__ = [
    "SchemaError",
    "StoreAccessError",
    "make_engine",
    "require_current_schema",
    "store_failure",
    "upgrade",
]
