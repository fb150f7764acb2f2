#ifndef KOKKOSMOE_EXPERTS_WEIGHTS_HPP
#define KOKKOSMOE_EXPERTS_WEIGHTS_HPP

/// \file KokkosMoE_Experts_Weights.hpp
/// \brief SwiGLU expert weights of a rank's local physical slots: storage,
/// deterministic initialisation, per-slot checkpoint version and content
/// digest, and parallel HDF5 checkpoints.
///
/// Local slot q (0..L-1, the rank's slots in ascending physical slot order,
/// i.e. the expert-major segment order) stores logical expert
/// slot_expert()[q]. Its parameters are
///
///     gate(q) [d_ff, d], up(q) [d_ff, d], down(q) [d, d_ff]   (row-major)
///
/// and the expert maps a row x [d] to (SiLU(x Wg^T) * (x Wu^T)) Wd^T.
/// Storage is float or bf16_t; every runner accumulates in FP32.
///
/// The content of a slot is a function of its logical expert alone (seed and
/// expert id for random initialisation, the expert's row for checkpoints), so
/// replicas of one expert are bitwise identical on any rank and at any rank
/// count, and carry the same digest.

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace KokkosMoE {
namespace Experts {

/// \brief Element type of stored weights.
enum class WeightDType : int {
  fp32 = 0,  ///< IEEE binary32
  bf16 = 1,  ///< bfloat16 (upper half of binary32)
};

/// \brief "float32" or "bfloat16" (the spelling used in checkpoint files).
inline EnumTable<WeightDType> const& names_of(WeightDType) {
  static EnumTable<WeightDType> const t{"weight dtype", {{WeightDType::fp32, "float32"}, {WeightDType::bf16, "bfloat16"}}};
  return t;
}

/// \brief The WeightDType of a storage type (float or bf16_t).
template <class T>
constexpr WeightDType weight_dtype_of() {
  static_assert(std::is_same<T, float>::value || std::is_same<T, bf16_t>::value,
                "Experts: weights are stored as float or bf16_t");
  return std::is_same<T, float>::value ? WeightDType::fp32 : WeightDType::bf16;
}

/// \brief What the ranks load weights for; ExpertWeights::load checks that
/// every rank holds the same before it reads anything.
struct LoadContext {
  std::uint64_t epoch = 0;       ///< communicator epoch of the ranks' communicator set
  std::uint64_t generation = 0;  ///< placement generation the slots belong to
};

namespace Impl {

/// Per-slot host view of a weight set, for the non-template I/O code.
struct HostWeightsRef {
  WeightDType dtype = WeightDType::fp32;
  int d = 0, d_ff = 0;
  std::vector<int> const* slot_expert = nullptr;
  void* gate = nullptr;  ///< [L, d_ff, d]
  void* up = nullptr;    ///< [L, d_ff, d]
  void* down = nullptr;  ///< [L, d, d_ff]
};

/// Digests of slot q: tensor[0..2] = digest_bytes of gate(q), up(q), down(q)
/// (default seed); slot = the three chained in that order.
struct SlotDigests {
  std::uint64_t tensor[3] = {0, 0, 0};
  std::uint64_t slot = 0;
};
SlotDigests slot_digests(HostWeightsRef const& w, int q);

/// Collective HDF5 checkpoint I/O (see ExpertWeights::save / load).
void save_weights_hdf5(MPI_Comm comm, std::string const& path, int num_experts, HostWeightsRef const& w,
                       std::vector<std::uint64_t> const& versions);
void load_weights_hdf5(MPI_Comm comm, std::string const& path, HostWeightsRef const& w,
                       std::vector<std::uint64_t>& versions, std::vector<std::uint64_t>& digests);

/// Counter-based uniform value in [-1, 1) of element i of tensor t (0 gate,
/// 1 up, 2 down) of logical expert e: a function of (seed, e, t, i) only.
KOKKOS_INLINE_FUNCTION float init_uniform(std::uint64_t seed, int e, int t, std::uint64_t i) {
  std::uint64_t x = seed ^ (0x9E3779B97F4A7C15ULL * (static_cast<std::uint64_t>(e) * 4u + static_cast<std::uint64_t>(t) + 1u));
  x += 0xD1B54A32D192ED03ULL * (i + 1u);
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 40) * (1.0 / 8388608.0) - 1.0);
}

/// w(q, r, c) = scale * init_uniform(seed, experts(q), t, r * cols + c), rounded to T.
template <class ExecutionSpace, class Tensor, class ExpertIds>
void fill_init(ExecutionSpace const& exec, Tensor const& w, ExpertIds const& experts, std::uint64_t seed, int t, float scale) {
  using T = typename Tensor::non_const_value_type;
  std::size_t const per = w.extent(1) * w.extent(2);
  std::size_t const total = w.extent(0) * per;
  T* data = w.data();
  Kokkos::parallel_for(
      "KokkosMoE::Experts::ExpertWeights::randomize",
      Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, total), KOKKOS_LAMBDA(std::size_t idx) {
        std::size_t const q = idx / per, i = idx - q * per;
        data[idx] = from_float<T>(scale * init_uniform(seed, experts(q), t, i));
      });
}

}  // namespace Impl

/// \brief The SwiGLU weights (or scalar test experts) of a rank's local slots.
///
/// \tparam T storage type, float or bf16_t.
/// \tparam MemorySpace where the tensors live.
///
/// Copies share the tensors (Kokkos view semantics); host metadata (slot
/// experts, versions, digests, scalar scales) is copied by value.
template <class T = float, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
class ExpertWeights {
 public:
  using value_type = T;
  using memory_space = MemorySpace;
  /// \brief [L, rows, cols] row-major tensor of all local slots.
  using tensor_type = Kokkos::View<T***, Kokkos::LayoutRight, MemorySpace>;

  /// \brief Empty (no slots). User-provided on purpose: GCC 12 can leave the
  /// View members of an implicitly or "= default" constructed class
  /// zero-filled instead of default-constructed with the mdspan-based View of
  /// Kokkos >= 4.6, which breaks their reference counting.
  ExpertWeights() {}

  /// \brief Allocates zero-initialised SwiGLU weights.
  /// \param label prefix of the allocation labels.
  /// \param slot_expert logical expert of each local slot (size L >= 0, ids >= 0).
  /// \param d hidden width (>= 1).
  /// \param d_ff intermediate width (>= 1).
  /// Versions and digests start at 0 ("not initialised"); call randomize(),
  /// load() or refresh_digests().
  ExpertWeights(std::string const& label, std::vector<int> slot_expert, int d, int d_ff)
      : label_(label), slot_expert_(std::move(slot_expert)), d_(d), d_ff_(d_ff) {
    KOKKOSMOE_REQUIRE(d >= 1 && d_ff >= 1, "ExpertWeights '" << label << "': d = " << d << " and d_ff = " << d_ff
                                                             << " must both be >= 1");
    check_slot_experts();
    int const L = num_slots();
    gate_ = tensor_type(label + "::gate", L, d_ff, d);
    up_ = tensor_type(label + "::up", L, d_ff, d);
    down_ = tensor_type(label + "::down", L, d, d_ff);
    version_.assign(static_cast<std::size_t>(L), 0);
    digest_.assign(static_cast<std::size_t>(L), 0);
  }

  /// \brief Scalar test experts: local slot q maps x -> s_q * x with
  /// s_q = expert_scale[slot_expert[q]] (expert_scale indexed by logical
  /// expert id). No SwiGLU tensors (d_ff() == 0); run them with
  /// RunnerKind::scalar.
  static ExpertWeights scalar(std::string const& label, std::vector<int> slot_expert, int d,
                              std::vector<float> const& expert_scale) {
    ExpertWeights w;
    w.label_ = label;
    w.slot_expert_ = std::move(slot_expert);
    w.d_ = d;
    w.d_ff_ = 0;
    KOKKOSMOE_REQUIRE(d >= 1, "ExpertWeights::scalar '" << label << "': d = " << d << " must be >= 1");
    w.check_slot_experts();
    w.version_.assign(w.slot_expert_.size(), 0);
    w.digest_.assign(w.slot_expert_.size(), 0);
    w.set_scalar_scales(expert_scale);
    return w;
  }

  /// \brief Sets (or replaces) the scalar test-expert scales, indexed by
  /// logical expert id; every local slot's expert must have one.
  void set_scalar_scales(std::vector<float> const& expert_scale) {
    int const L = num_slots();
    std::vector<float> s(static_cast<std::size_t>(L));
    for (int q = 0; q < L; ++q) {
      int const e = slot_expert_[static_cast<std::size_t>(q)];
      KOKKOSMOE_REQUIRE(static_cast<std::size_t>(e) < expert_scale.size(),
                        "ExpertWeights '" << label_ << "': local slot " << q << " stores expert " << e << " but only "
                                          << expert_scale.size() << " expert scales were given");
      s[static_cast<std::size_t>(q)] = expert_scale[static_cast<std::size_t>(e)];
    }
    scale_host_ = s;
    has_scalar_ = true;
    scale_ = Kokkos::View<float*, MemorySpace>(label_ + "::scalar_scale", L);
    auto h = Kokkos::create_mirror_view(Kokkos::HostSpace(), scale_);
    for (int q = 0; q < L; ++q) h(q) = s[static_cast<std::size_t>(q)];
    Kokkos::deep_copy(scale_, h);
  }

  std::string const& label() const { return label_; }
  /// \brief L, the number of local slots.
  int num_slots() const { return static_cast<int>(slot_expert_.size()); }
  int d() const { return d_; }
  /// \brief Intermediate width; 0 for scalar-only experts.
  int d_ff() const { return d_ff_; }
  static constexpr WeightDType dtype() { return weight_dtype_of<T>(); }
  /// \brief True when the SwiGLU tensors exist.
  bool has_swiglu() const { return d_ff_ > 0; }
  /// \brief True when scalar test-expert scales are set.
  bool has_scalar() const { return has_scalar_; }
  /// \brief Logical expert of each local slot.
  std::vector<int> const& slot_expert() const { return slot_expert_; }

  /// \brief [L, d_ff, d].
  tensor_type const& gate() const { return gate_; }
  /// \brief [L, d_ff, d].
  tensor_type const& up() const { return up_; }
  /// \brief [L, d, d_ff].
  tensor_type const& down() const { return down_; }
  /// \brief [L] scalar test-expert scale of each local slot (empty unless set).
  Kokkos::View<float*, MemorySpace> const& scalar_scale() const { return scale_; }
  std::vector<float> const& scalar_scale_host() const { return scale_host_; }

  /// \brief Checkpoint version of local slot q (0: never initialised).
  std::uint64_t version(int q) const { return version_.at(static_cast<std::size_t>(q)); }
  /// \brief Content digest of local slot q: digest_bytes over the stored
  /// bytes of gate(q), up(q), down(q), chained in that order (as of the last
  /// randomize / load / refresh_digests).
  std::uint64_t digest(int q) const { return digest_.at(static_cast<std::size_t>(q)); }
  std::vector<std::uint64_t> const& versions() const { return version_; }
  std::vector<std::uint64_t> const& digests() const { return digest_; }
  /// \brief Sets every slot's checkpoint version.
  void set_version(std::uint64_t version) { version_.assign(version_.size(), version); }

  /// \brief Deterministic random initialisation on exec: element i of tensor
  /// t of logical expert e is Impl::init_uniform(seed, e, t, i) scaled by
  /// 1/sqrt(fan-in) (d for gate/up, d_ff for down), rounded to T. Sets every
  /// slot's version and recomputes the digests (fences exec).
  template <class ExecutionSpace,
            typename std::enable_if<Kokkos::is_execution_space<ExecutionSpace>::value, int>::type = 0>
  void randomize(ExecutionSpace const& exec, std::uint64_t seed, std::uint64_t version = 1) {
    require_swiglu("randomize");
    static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                  "ExpertWeights::randomize: the execution space cannot access the weights' memory space");
    int const L = num_slots();
    Kokkos::View<int*, MemorySpace> experts(Kokkos::view_alloc(Kokkos::WithoutInitializing, label_ + "::init_experts"), L);
    auto he = Kokkos::create_mirror_view(Kokkos::HostSpace(), experts);
    for (int q = 0; q < L; ++q) he(q) = slot_expert_[static_cast<std::size_t>(q)];
    Kokkos::deep_copy(exec, experts, he);
    Impl::fill_init(exec, gate_, experts, seed, 0, 1.0f / std::sqrt(static_cast<float>(d_)));
    Impl::fill_init(exec, up_, experts, seed, 1, 1.0f / std::sqrt(static_cast<float>(d_)));
    Impl::fill_init(exec, down_, experts, seed, 2, 1.0f / std::sqrt(static_cast<float>(d_ff_)));
    Compat::fence(exec, "KokkosMoE::Experts::ExpertWeights::randomize");
    version_.assign(version_.size(), version);
    refresh_digests();
  }

  /// \brief Convenience overload on the default execution space instance.
  void randomize(std::uint64_t seed, std::uint64_t version = 1) {
    randomize(typename MemorySpace::execution_space(), seed, version);
  }

  /// \brief Recomputes every slot's digest from the stored bytes (host copy;
  /// the caller has fenced whatever wrote the tensors).
  void refresh_digests() {
    if (!has_swiglu()) return;
    auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), gate_);
    auto hu = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), up_);
    auto hd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), down_);
    Impl::HostWeightsRef ref = host_ref(hg.data(), hu.data(), hd.data());
    for (int q = 0; q < num_slots(); ++q) digest_[static_cast<std::size_t>(q)] = Impl::slot_digests(ref, q).slot;
  }

  /// \brief Collective over comm: writes the experts of every rank's slots to
  /// an HDF5 file through MPI-IO (overwriting it).
  ///
  /// Layout, indexed by logical expert id e in [0, num_experts):
  ///   /w_gate [E, d_ff, d], /w_up [E, d_ff, d], /w_down [E, d, d_ff]
  ///   (float32, or bfloat16 as a 16-bit HDF5 float type with 8 exponent bits);
  ///   each dataset has attributes "dtype" (string), "shape" (int64[3]) and
  ///   "content_digest" (uint64[E], digest_bytes of that tensor's row e);
  ///   the root group has "format" = "KokkosMoE.ExpertWeights",
  ///   "format_version", "num_experts", "d", "d_ff", "dtype",
  ///   "checkpoint_version" (uint64[E]) and "content_digest" (uint64[E], the
  ///   slot digest of expert e).
  /// Every expert in [0, num_experts) must be stored on some rank; replicas
  /// must agree in digest and version (the lowest rank's copy is written).
  /// All ranks must pass the same num_experts and have the same d, d_ff, T;
  /// the digests written are recomputed from the bytes written.
  /// Throws CollectiveError on every rank on any failure (message names the
  /// file, dataset and values).
  void save(MPI_Comm comm, std::string const& path, int num_experts) const {
    auto hg = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), gate_);
    auto hu = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), up_);
    auto hd = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), down_);
    Impl::save_weights_hdf5(comm, path, num_experts, host_ref(hg.data(), hu.data(), hd.data()), version_);
  }

  /// \brief Collective over comm: reads the rows of this rank's slot experts
  /// from a file written by save() (any rank count or placement), verifies
  /// shape, dtype, per-tensor and per-slot digests, and sets every slot's
  /// version and digest from the file. Throws CollectiveError on every rank
  /// when the file or a dataset is missing, a shape/dtype differs from this
  /// object's, an expert id is out of range, or a digest does not match the
  /// bytes read (the message names file, dataset and both values), or when
  /// these are scalar test experts. The tensors are unchanged when it throws.
  /// Before the file is opened, the ranks agree on `context` (the
  /// communicator epoch and placement generation they load for): a rank that
  /// holds a stale one makes every rank throw CollectiveError naming it.
  void load(MPI_Comm comm, std::string const& path, LoadContext const& context = LoadContext()) {
    std::string const region = "expert weights load of '" + path + "'";
    agree_same(comm, region.c_str(), {{"communicator epoch", context.epoch}, {"placement generation", context.generation}});
    auto hg = Kokkos::create_mirror(Kokkos::HostSpace(), gate_);
    auto hu = Kokkos::create_mirror(Kokkos::HostSpace(), up_);
    auto hd = Kokkos::create_mirror(Kokkos::HostSpace(), down_);
    std::vector<std::uint64_t> versions = version_, digests = digest_;
    Impl::load_weights_hdf5(comm, path, host_ref(hg.data(), hu.data(), hd.data()), versions, digests);
    Kokkos::deep_copy(gate_, hg);
    Kokkos::deep_copy(up_, hu);
    Kokkos::deep_copy(down_, hd);
    version_ = versions;
    digest_ = digests;
  }

 private:
  void check_slot_experts() const {
    for (std::size_t q = 0; q < slot_expert_.size(); ++q)
      KOKKOSMOE_REQUIRE(slot_expert_[q] >= 0, "ExpertWeights '" << label_ << "': local slot " << q << " has logical expert "
                                                                << slot_expert_[q] << " (must be >= 0)");
  }

  void require_swiglu(char const* what) const {
    KOKKOSMOE_REQUIRE(has_swiglu(), "ExpertWeights '" << label_ << "'::" << what
                                                      << ": these are scalar test experts (no SwiGLU tensors)");
  }

  Impl::HostWeightsRef host_ref(void* g, void* u, void* dn) const {
    Impl::HostWeightsRef r;
    r.dtype = dtype();
    r.d = d_;
    r.d_ff = d_ff_;
    r.slot_expert = &slot_expert_;
    r.gate = g;
    r.up = u;
    r.down = dn;
    return r;
  }

  std::string label_;
  std::vector<int> slot_expert_;
  int d_ = 0, d_ff_ = 0;
  tensor_type gate_, up_, down_;
  std::vector<std::uint64_t> version_, digest_;
  Kokkos::View<float*, MemorySpace> scale_;
  std::vector<float> scale_host_;
  bool has_scalar_ = false;
};

}  // namespace Experts
}  // namespace KokkosMoE

#endif
