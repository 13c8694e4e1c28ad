"""Spark machinery: what every training mode runs through.

Session, backend (classic / Connect), preflight checks, the barrier-stage runner, the task
wrapper, failures, rendezvous, devices.
"""
