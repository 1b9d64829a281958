"""The `mlxrt` command line and the benchmark against mlx-lm."""
