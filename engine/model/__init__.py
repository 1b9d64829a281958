"""A model on the MLX thread, before any request: loading it and the world it is sharded over.

- `loader`: an mlx-lm directory, a GGUF file (`gguf/`) or a built-in model loaded, weights
  cast and layers probed, as a `LoadedModel` (the KV format applied by `with_kv_format`);
- `weights`: the CPU backend's policy for quantized weights (dequantized at load, or kept);
- `patches`: fix-ups for mlx-lm layer code that only ever sees one sequence (not LoRA);
- `memory`: weight bytes estimated before a load, buffers given back after one;
- `world`: an mlx.distributed world (sharding, rank 0's `Leader`, a follower's `follow`),
  over the authenticated control connections of `control`.

Building the engine for a loaded model is `engine.build`.
"""
