"""Code that runs on the MLX thread: model loading, batched caches, sampling, steps.

Nothing in this package may be called from the event loop; `ModelActor` submits
work to the dedicated MLX thread (`runtime.mlx_thread`) which calls into here.
"""
