"""KV storage on the MLX thread: where each layer keeps a request's positions.

- `layout`: each layer's cache kind, probed from the model at load (and the dtype names);
- `slots`: the decode batch's rows per layer kind (full, window, state, list) and the buffer
  helpers the other full-attention kinds share; `factory.make_slots` picks a layer's kind,
  plain, quantized (`quantized`, `kv.bits`) or paged (`paged`, `kv.block_size`, its blocks in
  `pool`); `offsets`: the trim and mask those kinds share outside the batch;
- `tables`: a request's block table in the paged pool, admission to release;
- `caches`: one request's caches outside the batch (copies, prefix views, checkpoint tensors);
- `prefixes`: saved prefix entries, by entry id;
- `attention`: lets a cache attend by itself (paged decode reads its blocks in place).

No module here imports the step (`engine.engine`), the request state (`engine.sequence`: what
the KV code needs of a request is `request.KvRequest`) or the model's loading (`engine.model`).
"""
