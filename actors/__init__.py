"""The runtime's actors (one module each) and their synchronous policies."""
