"""The actors (one module each) and their plumbing: bounded mailboxes and the MLX thread.

An actor owns its state and one inbox, reads `protocols` messages with `match`, and turns
them into calls on `policies` (decisions) or, for the model lease, on the `engine`.
"""
