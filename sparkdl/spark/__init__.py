"""Spark machinery: session, backend (classic / Connect), preflight checks, the barrier-stage runner, the task wrapper, failures, rendezvous, devices."""
