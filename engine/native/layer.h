// A decode step's decoder layer (mlx-lm's llama `TransformerBlock`; qwen2's is the same operations)
// over paged KV with quantized projections, as four primitives in place of the fused attention's
// sixteen nodes (`engine.compiled`): each node costs its evaluation a few microseconds beyond its
// kernel on the CPU backend (built from the trace, allocated, queued, a task holding its inputs),
// on the thread that evaluates the graph and on the one that runs the kernels.
// - `NormedProducts`: `rms_norm(x, weight, eps)` times each of several quantized weights (plus
//   its bias, where it has one): the layer's queries, keys and values, one output each;
// - the keys and the values written into the pools by `PoolWrite` (kernels.cpp: a node of one
//   output, so that MLX gives it the pool's buffer);
// - `LayerTail`: `DecodeAttention`'s attention of the queries, the output projection and the
//   residual, the post-attention norm, the gate and up projections, SwiGLU, the down projection
//   and the residual: the layer's output.
// Each operation is the kernel the unfused step runs on the same values (`qmm_kernel`,
// `rms_norm_rows`, `rope_rows`, `paged_attention_rows`, `swiglu_kernel`, and a bias or a residual
// added as MLX adds two arrays: one rounding each), so the same bits.

// A quantized product inside a fused primitive: its weight's group size and bits, whether a bias
// follows its weight, scales and biases among the primitive's inputs, and its biases' ratio to its
// scales (`quantized_matmul`'s `bias_ratio`: 0, or the power of two they are exactly the scales times).
struct ProductSpec {
  int group, bits;
  bool bias;
  float bias_ratio;
  bool operator==(const ProductSpec& o) const { return group == o.group && bits == o.bits && bias == o.bias && bias_ratio == o.bias_ratio; }
};

// A product's operands as the kernels read them.
struct ProductArgs {
  const uint32_t* w;
  const float *scales, *biases, *bias;
  int n, k, group, bits;
  float bias_ratio;
};

// (w, scales, biases, bias, group, bits, bias_ratio)
using Product = std::tuple<mx::array, mx::array, mx::array, std::optional<mx::array>, int, int, float>;

// `out` [rows, n] plus the product's bias, where it has one (as MLX adds it: one rounding each).
static void add_bias(const ProductArgs& p, int rows, float* out) {
  if (p.bias == nullptr) return;
  for (int r = 0; r < rows; r++) {
    float* row = out + static_cast<size_t>(r) * p.n;
    for (int j = 0; j < p.n; j++) row[j] = row[j] + p.bias[j];
  }
}

// `x` [rows, k] times the weight (transposed), plus the bias: `out` [rows, n].
static void product(const float* x, int rows, const ProductArgs& p, float* out) {
  if (p.bits == 4) {
    qmm_kernel<4>(x, rows, p.k, p.w, p.scales, p.biases, p.bias_ratio, p.group, out, p.n, true);
  } else {
    qmm_kernel<8>(x, rows, p.k, p.w, p.scales, p.biases, p.bias_ratio, p.group, out, p.n, true);
  }
  add_bias(p, rows, out);
}

// `x` [rows, k] times several products' weights (plus their biases) into `outs`: where they have
// one bit width and a few rows, the input prepared once and every product's chunks one job shared
// with the helper (one wait for it, not one a product; `qmm_kernel` otherwise). Each feature is
// computed by the tile `qmm_kernel` computes it with (the same chunks): the same bits. (The
// layer's queries, keys and values, and its gate and up products: SmolLM2 Q4's c1 step 7.50
// against 7.90 ms, paired windows, faster in 7 of 8; four rows' unchanged.)
static void products(const float* x, int rows, const ProductArgs* const* ps, float* const* outs, int count) {
  const int k = ps[0]->k, bits = ps[0]->bits;
  bool shared = count > 1 && !panel_rows(rows, k);
  for (int p = 0; p < count; p++) shared = shared && ps[p]->bits == bits && ps[p]->k == k;
  if (!shared) {
    for (int p = 0; p < count; p++) product(x, rows, *ps[p], outs[p]);
    return;
  }
  const bool wide = has_avx512();
  const TileInput input(x, rows, k, bits, wide);
  struct Span {
    int p, chunk, chunks;
  };
  std::vector<Span> spans;
  for (int p = 0; p < count; p++) {
    const int chunks = feature_chunks(ps[p]->n, k, bits);
    for (int i = 0; i < chunks; i++) spans.push_back({p, i, chunks});
  }
  auto span = [&](int i) {
    const auto& s = spans[i];
    const auto& a = *ps[s.p];
    const auto [n0, n1] = chunk_features(s.chunk, s.chunks, a.n);
    const auto* w = reinterpret_cast<const uint8_t*>(a.w);
    if (bits == 4) {
      tile_features<4>(input.data(), rows, k, w, a.scales, a.biases, a.bias_ratio, a.group, outs[s.p], n0, n1, a.n, wide);
    } else {
      tile_features<8>(input.data(), rows, k, w, a.scales, a.biases, a.bias_ratio, a.group, outs[s.p], n0, n1, a.n, wide);
    }
  };
  Helper::instance().share(static_cast<int>(spans.size()), span);
  for (int p = 0; p < count; p++) add_bias(*ps[p], rows, outs[p]);
}

// The products' operands among `inputs`, from `first` on, as `specs` lay them out.
static std::vector<ProductArgs> product_args(const std::vector<mx::array>& inputs, size_t first, const std::vector<ProductSpec>& specs) {
  std::vector<ProductArgs> args;
  size_t i = first;
  for (const auto& s : specs) {
    const auto& w = inputs[i];
    args.push_back({w.data<uint32_t>(), inputs[i + 1].data<float>(), inputs[i + 2].data<float>(), s.bias ? inputs[i + 3].data<float>() : nullptr, w.shape(0),
                    static_cast<int>(w.shape(1) * 32 / s.bits), s.group, s.bits, s.bias_ratio});
    i += s.bias ? 4 : 3;
  }
  return args;
}

// `products` checked against an input `k` wide and laid out as inputs (appended to `inputs`);
// returns their specs and output widths.
static std::vector<ProductSpec> add_products(const std::vector<Product>& products, int k, std::vector<mx::array>& inputs, std::vector<int>& widths) {
  std::vector<ProductSpec> specs;
  for (const auto& [w, scales, biases, bias, group, bits, bias_ratio] : products) {
    const int n = check_quantized(k, w, scales, biases, group, bits);
    check_bias_ratio(bias_ratio);
    if (bias && (bias->dtype() != mx::float32 || bias->ndim() != 1 || bias->shape(0) != n)) {
      throw std::invalid_argument("[mlxrt.native] a product's bias must be float32 [n]");
    }
    inputs.insert(inputs.end(), {w, scales, biases});
    if (bias) inputs.push_back(*bias);
    specs.push_back({group, bits, bias.has_value(), bias_ratio});
    widths.push_back(n);
  }
  return specs;
}

class NormedProducts : public CpuPrimitive {
 public:
  NormedProducts(mx::Stream stream, float eps, std::vector<ProductSpec> specs)
      : CpuPrimitive(stream, "MlxrtNormedProducts"), eps_(eps), specs_(std::move(specs)) {}
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    size_t i = 2;
    for (const auto& s : specs_) {
      auto shape = inputs[0].shape();
      shape.back() = inputs[i].shape(0);
      shapes.push_back(shape);
      i += s.bias ? 4 : 3;
    }
    return shapes;
  }
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    std::vector<float*> outs;
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      outs.push_back(out.data<float>());
    }
    const int k = inputs[0].shape(-1);
    const int rows = static_cast<int>(inputs[0].size() / k);
    queue([x = inputs[0].data<float>(), weight = inputs[1].data<float>(), products = product_args(inputs, 2, specs_), outs = std::move(outs), rows, k,
           eps = eps_]() {
      std::vector<float> normed(static_cast<size_t>(rows) * k);
      rms_norm_rows(x, weight, normed.data(), rows, k, eps);
      std::vector<const ProductArgs*> ps;
      for (const auto& p : products) ps.push_back(&p);
      mlxrt::products(normed.data(), rows, ps.data(), outs.data(), static_cast<int>(ps.size()));
    });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    const auto& o = static_cast<const NormedProducts&>(other);
    return eps_ == o.eps_ && specs_ == o.specs_;
  }

 private:
  float eps_;
  std::vector<ProductSpec> specs_;
};

// Inputs: the layer's input `x` [rows, 1, dim] (the residual), the queries [rows, 1, heads * head
// dim], the pools, blocks, positions and lengths (`DecodeAttention`'s), the post-attention norm's
// weight, then the output, gate, up and down products.
class LayerTail : public CpuPrimitive {
 public:
  LayerTail(mx::Stream stream, int heads, RopeParams rope, float scale, int width, int block_size, float eps, std::vector<ProductSpec> specs)
      : CpuPrimitive(stream, "MlxrtLayerTail"),
        heads_(heads),
        rope_(rope),
        scale_(scale),
        width_(width),
        block_size_(block_size),
        eps_(eps),
        specs_(std::move(specs)) {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, true);  // (each element of `x` is read before its own is written)
    const auto& pool_k = inputs[2];
    const int d = inputs[0].shape(-1), rows = static_cast<int>(inputs[0].size() / d);
    const int kv_heads = pool_k.shape(0), positions = pool_k.shape(1), dim = pool_k.shape(2);
    const int per_row_blocks = static_cast<int>(inputs[4].size() / rows);
    const auto products = product_args(inputs, 8, specs_);
    run(inputs, out,
        [x = inputs[0].data<float>(), q = inputs[1].data<float>(), pk = pool_k.data<float>(), pv = inputs[3].data<float>(), blocks = inputs[4].data<int32_t>(),
         where = inputs[5].data<int32_t>(), lengths = inputs[6].data<int32_t>(), weight = inputs[7].data<float>(), y = out.data<float>(), products, rows, d,
         kv_heads, positions, dim, per_row_blocks, heads = heads_, rope = rope_, scale = scale_, width = width_, block_size = block_size_, eps = eps_]() {
          const auto &o_proj = products[0], &gate_proj = products[1], &up_proj = products[2], &down_proj = products[3];
          const size_t n = static_cast<size_t>(rows) * d, hidden = static_cast<size_t>(rows) * gate_proj.n;
          std::vector<float> queries(static_cast<size_t>(rows) * heads * dim), attended(queries.size()), projected(n), normed(n), gate(hidden), up(hidden);
          rope_rows(q, queries.data(), where, rows > 1, rows, heads, 1, dim, rope.dims, rope.traditional, rope.base, rope.scale);
          for (float& v : queries) v = scale * v;
          paged_attention_rows(queries.data(), pk, pv, blocks, nullptr, nullptr, false, lengths, attended.data(), rows, kv_heads, heads / kv_heads, dim,
                               positions, per_row_blocks, width, block_size);
          product(attended.data(), rows, o_proj, projected.data());
          for (size_t i = 0; i < n; i++) y[i] = x[i] + projected[i];
          rms_norm_rows(y, weight, normed.data(), rows, d, eps);
          const ProductArgs* mlp[] = {&gate_proj, &up_proj};
          float* mlp_out[] = {gate.data(), up.data()};
          mlxrt::products(normed.data(), rows, mlp, mlp_out, 2);
          swiglu_kernel(gate.data(), up.data(), gate.data(), hidden);
          product(gate.data(), rows, down_proj, projected.data());
          for (size_t i = 0; i < n; i++) y[i] = y[i] + projected[i];
        });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    const auto& o = static_cast<const LayerTail&>(other);
    return heads_ == o.heads_ && rope_ == o.rope_ && scale_ == o.scale_ && width_ == o.width_ && block_size_ == o.block_size_ && eps_ == o.eps_ &&
           specs_ == o.specs_;
  }

 private:
  int heads_;
  RopeParams rope_;
  float scale_;
  int width_, block_size_;
  float eps_;
  std::vector<ProductSpec> specs_;
};

static void check_norm(const mx::array& x, const mx::array& weight, const char* what) {
  check_float32(x, what);
  check_float32(weight, what);
  if (x.ndim() == 0 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument(std::string("[mlxrt.native] ") + what + ": the norm's weight must be as long as the input's last axis");
  }
}

// `NormedProducts` (above): [rms_norm(x, weight, eps) @ w.T (+ bias) for each product].
std::vector<mx::array> normed_products(const mx::array& x, const mx::array& weight, float eps, const std::vector<Product>& products, mx::StreamOrDevice s) {
  check_norm(x, weight, "normed_products");
  if (products.empty()) throw std::invalid_argument("[mlxrt.native] normed_products: no products");
  std::vector<mx::array> inputs = {x, weight};
  std::vector<int> widths;
  auto specs = add_products(products, x.shape(-1), inputs, widths);
  std::vector<mx::Shape> shapes;
  for (int n : widths) {
    auto shape = x.shape();
    shape.back() = n;
    shapes.push_back(shape);
  }
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(widths.size(), mx::float32),
                                std::make_shared<NormedProducts>(mx::to_stream(s), eps, std::move(specs)), inputs);
}

// `LayerTail` (above): products in the order output, gate, up, down.
mx::array layer_tail(const mx::array& x, const mx::array& queries, const mx::array& pool_keys, const mx::array& pool_values, const mx::array& blocks,
                     const mx::array& positions, const mx::array& lengths, const mx::array& weight, const std::vector<Product>& products, int heads,
                     int rope_dims, bool traditional, float base, float rope_scale, float scale, int width, int block_size, float eps,
                     mx::StreamOrDevice s) {
  check_norm(x, weight, "layer_tail");
  if (x.ndim() != 3 || x.shape(1) != 1 || queries.ndim() != 3 || queries.shape(0) != x.shape(0) || products.size() != 4) {
    throw std::invalid_argument("[mlxrt.native] layer_tail: x [rows, 1, dim], queries [rows, 1, heads * head dim], four products");
  }
  check_decode_attention(queries, pool_keys, pool_values, blocks, positions, lengths, heads, width, block_size);
  std::vector<mx::array> inputs = {x, queries, pool_keys, pool_values, blocks, positions, lengths, weight};
  std::vector<int> widths;
  const int d = x.shape(-1), hidden = std::get<0>(products[1]).shape(0);
  std::vector<ProductSpec> specs = add_products({products[0]}, queries.shape(-1), inputs, widths);
  for (const auto& spec : add_products({products[1], products[2]}, d, inputs, widths)) specs.push_back(spec);
  specs.push_back(add_products({products[3]}, hidden, inputs, widths)[0]);
  if (widths[0] != d || widths[1] != hidden || widths[2] != hidden || widths[3] != d) {
    throw std::invalid_argument("[mlxrt.native] layer_tail: the output and down products must give the input's width, gate and up one width");
  }
  auto rope = rope_params(rope_dims, traditional, base, rope_scale, pool_keys.shape(2));
  auto primitive = std::make_shared<LayerTail>(mx::to_stream(s), heads, rope, scale, width, block_size, eps, std::move(specs));
  return mx::array(x.shape(), mx::float32, primitive, std::move(inputs));
}
