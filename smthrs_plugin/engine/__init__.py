"""Durable engine state over the store: journal, runs, ownership (fence, liveness, heartbeat, stale sweep),
attempts, recovery. Import from the concept modules (``smthrs_plugin.records._runs`` ...); nothing is re-exported
here so that importing one concept never pays for the others."""
