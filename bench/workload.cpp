#include "workload.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <random>

#include "kvcomp/half.hpp"

namespace kvcomp::bench {

using i64 = std::int64_t;

const Profile* find_profile(const char* name) {
  for (const Profile& p : kProfiles)
    if (std::strcmp(p.name, name) == 0) return &p;
  return nullptr;
}

i64 varlen_batches(const Profile& p, i64 T, i64 wanted) {
  return std::min<i64>(wanted, std::max<i64>(1, T / (4 * p.r)));
}

namespace {

// n normal values times scale, rounded to bf16 or fp16 (io).
std::vector<std::uint16_t> random_16bit(std::size_t n, float scale, std::uint64_t seed, DType io) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<std::uint16_t> v(n);
  for (auto& e : v) e = io == DType::f16 ? float_to_fp16(g(rng) * scale) : float_to_bf16(g(rng) * scale);
  return v;
}

}  // namespace

struct Workload::Buffers {
  std::vector<std::int32_t> cu, table;
  std::vector<std::uint16_t> x, wkv, wgate, dcmp, cmp, dx, dwkv, dwgate;
  std::vector<float> ape, cache, S, K, dape;
};

Workload::Workload(const Case& c) : buf_(std::make_unique<Buffers>()) {
  Buffers& b = *buf_;
  const i64 C = c.p.coff * c.p.D, r = c.p.r, D = c.p.D, cr = c.p.coff * c.p.r, H = c.H, T = c.T;
  const i64 B = c.batches;
  const bool th = B > 1;
  // Sequence lengths: one sequence (BSH), or TH lengths drawn uniformly in
  // [0.5, 1.5] x T/B (seeded) and scaled to sum to T.
  b.cu.assign(static_cast<std::size_t>(B + 1), 0);
  {
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> u(0.5, 1.5);
    std::vector<double> w(static_cast<std::size_t>(B));
    double sum = 0;
    for (auto& e : w) sum += (e = u(rng));
    double acc = 0;
    for (i64 i = 0; i < B; ++i) {
      acc += w[static_cast<std::size_t>(i)];
      b.cu[static_cast<std::size_t>(i + 1)] =
          static_cast<std::int32_t>(i + 1 == B ? T : std::llround(static_cast<double>(T) * acc / sum));
    }
  }
  const i64 rows = th ? std::min(T, T / r + B) : (T + r - 1) / r;
  b.x = random_16bit(static_cast<std::size_t>(T * H), 1.0f, 1, c.io);
  b.wkv = random_16bit(static_cast<std::size_t>(C * H), 0.02f, 2, c.io);
  b.wgate = random_16bit(static_cast<std::size_t>(C * H), 0.02f, 3, c.io);
  b.dcmp = random_16bit(static_cast<std::size_t>(rows * D), 1.0f, 4, c.io);
  b.ape.assign(static_cast<std::size_t>(r * C), 0.01f);
  i64 max_len = th ? 0 : T, compressed = th ? 0 : T / r * r;
  for (i64 i = 0; th && i < B; ++i) {
    const i64 len = b.cu[static_cast<std::size_t>(i + 1)] - b.cu[static_cast<std::size_t>(i)];
    max_len = std::max(max_len, len);
    compressed += len / r * r;
  }
  compressed_fraction_ = static_cast<double>(compressed) / static_cast<double>(std::max<i64>(T, 1));
  const i64 bs = 128, cols = (max_len + bs - 1) / bs;
  b.cache.assign(static_cast<std::size_t>((B * cols + 1) * bs * 2 * C), 0.0f);
  b.table.resize(static_cast<std::size_t>(B * cols));
  for (std::size_t i = 0; i < b.table.size(); ++i) b.table[i] = static_cast<std::int32_t>(i + 1);
  b.cmp.resize(static_cast<std::size_t>(rows * D));
  b.S.resize(static_cast<std::size_t>(rows * cr * D));
  b.K.resize(b.S.size());
  b.dx.resize(b.x.size());
  b.dwkv.resize(b.wkv.size());
  b.dwgate.resize(b.wgate.size());
  b.dape.resize(b.ape.size());

  // BSH tensors carry a leading batch dimension of 1.
  auto io = [th](void* p, DType dt, std::initializer_list<i64> shape) {
    Tensor t(p, dt, shape);
    if (!th) {  // [1, ...shape]
      for (int i = t.rank; i > 0; --i)
        t.shape[static_cast<std::size_t>(i)] = t.shape[static_cast<std::size_t>(i - 1)];
      t.shape[0] = 1;
      ++t.rank;
    }
    return t;
  };
  f_.x = io(b.x.data(), c.io, {T, H});
  if (th) f_.cu_seqlens = Tensor(b.cu.data(), DType::i32, {B + 1});
  f_.wkv = Tensor(b.wkv.data(), c.io, {C, H});
  f_.wgate = Tensor(b.wgate.data(), c.io, {C, H});
  f_.cmp_ratio = r;
  f_.coff = c.p.coff;
  f_.state_cache = Tensor(b.cache.data(), DType::f32, {B * cols + 1, bs, 2 * C});
  f_.ape = Tensor(b.ape.data(), DType::f32, {r, C});
  f_.state_block_table = Tensor(b.table.data(), DType::i32, {B, cols});
  f_.grad_enabled = true;
  f_.cmp_kv = io(b.cmp.data(), c.io, {rows, D});
  f_.softmax_score = io(b.S.data(), DType::f32, {rows, cr, D});
  f_.kv = io(b.K.data(), DType::f32, {rows, cr, D});

  static_cast<SequenceArgs&>(g_) = static_cast<const SequenceArgs&>(f_);
  g_.d_cmp_kv = io(b.dcmp.data(), c.io, {rows, D});
  g_.softmax_score = f_.softmax_score;
  g_.kv = f_.kv;
  g_.d_x = io(b.dx.data(), c.io, {T, H});
  g_.d_wkv = Tensor(b.dwkv.data(), c.io, {C, H});
  g_.d_wgate = Tensor(b.dwgate.data(), c.io, {C, H});
  g_.d_ape = Tensor(b.dape.data(), DType::f32, {r, C});
}

Workload::~Workload() = default;

struct DecodeWorkload::Buffers {
  std::vector<std::int32_t> sp, table, cu;
  std::vector<std::uint16_t> x, wkv, wgate, cmp;
  std::vector<float> ape, cache;
};

DecodeWorkload::DecodeWorkload(const DecodeCase& c) : buf_(std::make_unique<Buffers>()) {
  Buffers& b = *buf_;
  const i64 C = c.p.coff * c.p.D, r = c.p.r, D = c.p.D, H = c.H, B = c.batches, S = c.tokens;
  b.x = random_16bit(static_cast<std::size_t>(B * S * H), 1.0f, 11, c.io);
  b.wkv = random_16bit(static_cast<std::size_t>(C * H), 0.02f, 12, c.io);
  b.wgate = random_16bit(static_cast<std::size_t>(C * H), 0.02f, 13, c.io);
  b.ape.assign(static_cast<std::size_t>(r * C), 0.01f);
  b.sp.assign(static_cast<std::size_t>(B), static_cast<std::int32_t>(c.start_pos));
  // cmp_kv rows: B x ceil(S / r) (BSH) or min(T, T / r + B) (TH)
  const i64 rows = c.th ? compressed_rows_th(B * S, B, r) : B * compressed_rows_bsh(S, r);
  b.cmp.resize(static_cast<std::size_t>(rows * D));
  i64 bs = 0, blocks = 0, cols = 1;
  if (c.ring) {
    bs = c.p.coff * r + S;
    blocks = B + 1;
    b.table.resize(static_cast<std::size_t>(B));
    for (i64 i = 0; i < B; ++i) b.table[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i + 1);
  } else {
    bs = 16;
    const i64 end = c.start_pos + S;
    cols = (end + bs - 1) / bs;
    const i64 first = std::max<i64>(0, (c.start_pos / r * r - c.p.coff * r) / bs);  // first column touched
    b.table.assign(static_cast<std::size_t>(B * cols), 0);
    std::int32_t next = 1;
    for (i64 i = 0; i < B; ++i)
      for (i64 col = first; col < cols; ++col) b.table[static_cast<std::size_t>(i * cols + col)] = next++;
    blocks = next;
  }
  b.cache.assign(static_cast<std::size_t>(blocks * bs * 2 * C), 0.0f);
  if (c.th) {
    for (i64 i = 0; i <= B; ++i) b.cu.push_back(static_cast<std::int32_t>(i * S));
    f_.x = Tensor(b.x.data(), c.io, {B * S, H});
    f_.cu_seqlens = Tensor(b.cu.data(), DType::i32, {B + 1});
    f_.cmp_kv = Tensor(b.cmp.data(), c.io, {rows, D});
  } else {
    f_.x = Tensor(b.x.data(), c.io, {B, S, H});
    f_.cmp_kv = Tensor(b.cmp.data(), c.io, {B, rows / B, D});
  }
  f_.wkv = Tensor(b.wkv.data(), c.io, {C, H});
  f_.wgate = Tensor(b.wgate.data(), c.io, {C, H});
  f_.cmp_ratio = r;
  f_.coff = c.p.coff;
  f_.start_pos = Tensor(b.sp.data(), DType::i32, {B});
  f_.state_cache = Tensor(b.cache.data(), DType::f32, {blocks, bs, 2 * C});
  f_.ape = Tensor(b.ape.data(), DType::f32, {r, C});
  f_.cache_mode = c.ring ? 2 : 1;
  f_.state_block_table =
      c.ring ? Tensor(b.table.data(), DType::i32, {B}) : Tensor(b.table.data(), DType::i32, {B, cols});
  f_.grad_enabled = false;
}

DecodeWorkload::~DecodeWorkload() = default;

namespace {

// One oneDNN matmul C[M,N] = A[M,K] . B[K,N] (A / B given transposed when
// a_t / b_t), f32 result, library threading. A weight operand B (pack_b) is
// held in the layout oneDNN's kernel reads (format any, reordered once here),
// so that the timed product does no per-call copy of B: the strictest
// baseline, as a server with prepared weights runs it (on AMX the brgemm
// kernel otherwise repacks a plain B on every execution).
struct Matmul {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  dnnl::matmul prim;
  dnnl::memory a, b, c;

  Matmul(i64 M, i64 N, i64 K, bool a_t, bool b_t, dnnl::memory::data_type dt, bool pack_b = false) {
    using tag = dnnl::memory::format_tag;
    const dnnl::memory::desc ad({M, K}, dt, a_t ? tag::ba : tag::ab);
    const dnnl::memory::desc bd({K, N}, dt, b_t ? tag::ba : tag::ab);
    const dnnl::memory::desc cd({M, N}, dnnl::memory::data_type::f32, tag::ab);
    const dnnl::memory::desc bd_prim = pack_b ? dnnl::memory::desc({K, N}, dt, tag::any) : bd;
    const dnnl::matmul::primitive_desc pd(eng, ad, bd_prim, cd);
    prim = dnnl::matmul(pd);
    a = dnnl::memory(ad, eng);
    c = dnnl::memory(cd, eng);
    fill(a, dt, ad.get_size());
    dnnl::memory plain(bd, eng);
    fill(plain, dt, bd.get_size());
    if (pd.weights_desc() == bd) {
      b = plain;
    } else {
      b = dnnl::memory(pd.weights_desc(), eng);
      dnnl::reorder(plain, b).execute(strm, plain, b);
      strm.wait();
    }
  }
  static void fill(dnnl::memory& m, dnnl::memory::data_type dt, std::size_t bytes) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    if (dt == dnnl::memory::data_type::f32) {
      auto* p = static_cast<float*>(m.get_data_handle());
      for (std::size_t i = 0; i < bytes / 4; ++i) p[i] = u(rng);
    } else {
      auto* p = static_cast<std::uint16_t*>(m.get_data_handle());
      for (std::size_t i = 0; i < bytes / 2; ++i) p[i] = float_to_bf16(u(rng));
    }
  }
  void run() {
    prim.execute(strm, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    strm.wait();
  }
};

}  // namespace

struct Products::Impl {
  std::vector<std::unique_ptr<Matmul>> products;
};

// With bf16 operands the weights W are pre-packed (Matmul's pack_b); dnew^T . x has no weight operand.
Products::Products(const Case& c, Which which, bool bf16_operands) : impl_(std::make_unique<Impl>()) {
  const auto dt = bf16_operands ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  const i64 C2 = 2 * c.p.coff * c.p.D;
  if (which == Which::forward) {
    impl_->products.push_back(std::make_unique<Matmul>(c.T, C2, c.H, false, true, dt, bf16_operands));
  } else {
    impl_->products.push_back(std::make_unique<Matmul>(c.T, c.H, C2, false, false, dt, bf16_operands));
    impl_->products.push_back(std::make_unique<Matmul>(C2, c.H, c.T, true, false, dt));
  }
}

Products::Products(const DecodeCase& c, bool bf16_operands) : impl_(std::make_unique<Impl>()) {
  const auto dt = bf16_operands ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  impl_->products.push_back(std::make_unique<Matmul>(c.batches * c.tokens, 2 * c.p.coff * c.p.D, c.H, false,
                                                     true, dt, bf16_operands));
}

Products::~Products() = default;

void Products::run() {
  for (auto& m : impl_->products) m->run();
}

}  // namespace kvcomp::bench
