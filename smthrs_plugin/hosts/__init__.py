"""Hosts: where plan node executions run. ``local`` (a thread pool); the Prefect host lives in ``prefect``."""
