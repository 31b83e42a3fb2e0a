"""rtrl foundations (types, config, store) and orchestration (cli; later cycle and daemon)."""

__version__ = "0.1.0"
