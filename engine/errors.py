"""The engine's own error: a plan that its state makes impossible (no MLX here).

Its own module so that the request state (`engine.sequence`) and the KV code below it
(`engine.kv.caches`, `engine.kv.prefixes`) can all raise it without importing each other.
"""


class EngineInvariantError(RuntimeError):
    """A plan asked for something the engine's state makes impossible (a scheduler bug)."""
