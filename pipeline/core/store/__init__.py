"""The store: tables (the schema source), engines and migrations, and the queries stages use.

Imports no torch, transformers, peft, mlflow or kafka: everything may depend on it.
"""

from pipeline.core.store.db import SchemaError, make_engine, require_current_schema, upgrade

__all__ = ["SchemaError", "make_engine", "require_current_schema", "upgrade"]
