"""The only package that imports `mlx`: everything here runs on the MLX thread.

Model loading (and the built-in models), the decode batch's caches, the batch sampler
and the engine that executes step plans. Nothing in it may be called from the event
loop; the model lease actor (`actors.model`) submits work to the MLX thread.
"""
