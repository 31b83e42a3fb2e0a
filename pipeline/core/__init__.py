"""The ground every stage stands on: configuration (config.py, train_config.py, decision_config.py, kafka_config.py),
the event contract and the records that cross stages (types.py), the store (store/), structured
logs, the broker client builders, and pure text checks. Nothing here imports a stage
(ingest, reward, train, deploy) or the orchestration above them (pipeline's cli, daemon, cycle,
demo); import-linter's contracts in pyproject.toml hold it to that."""
