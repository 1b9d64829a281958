"""Synchronous decisions, unit-tested on their own: no anyio, no mlx.

Scheduling, the KV ledger and prefix index, request validation, stop strings,
detokenizing, output parsing, and the fast-forwarding plans and sessions.
"""
