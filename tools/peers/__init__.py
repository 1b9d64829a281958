"""Other engines the benchmark runs beside mlxrt (bench-only: never needed to serve or test)."""
