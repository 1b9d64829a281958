"""The only package that imports `mlx`: everything here runs on the MLX thread.

Three concerns, one sub-package each, imported only downward (no cycles, no private names
across modules: `tests/engine/test_structure.py`):

- the step, at this level: `engine` (the `Engine` that executes step plans), `prefill`,
  `batch` (the decode batch), `forward`, `known` (jump-forward and fast-forward spans),
  `sampler`, `compiled` (a lone row's compiled step), `speculation` and `draft`, `lora`
  (the adapter bank), `sequence` (one request's state), `build` (one engine, built in one call),
  `embed` (embeddings: the model's body without its LM head, between steps);
- `kv/`: where each layer keeps a request's positions (slots, paged and quantized KV, block
  tables, per-request caches, prefix entries, the layout probe);
- `model/`: a model before any request (the loader, GGUF files, the CPU policy for quantized
  weights, mlx-lm patches, memory estimates, the distributed world);
- `builtin/`: the models `builtin:<name>` names (the packaged real model, random test models).

Nothing in it may be called from the event loop; the model lease actor (`actors.model`)
submits work to the MLX thread.
"""
