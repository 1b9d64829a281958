"""Helpers shared by test modules: the only `tests` modules a test may import (`tests/test_suite_layout.py`)."""
