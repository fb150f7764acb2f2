#ifndef KOKKOSMOE_SERVE_HPP
#define KOKKOSMOE_SERVE_HPP

/// \file KokkosMoE_Serve.hpp
/// \brief Serving mode: decode steps on a fixed bucket, an exact admission
/// predicate, a fallback that keeps every row and route, and mixed batches
/// split by phase.
///
/// A DecodeBucket holds, on every rank, buffers allocated once for a
/// per-rank token capacity Ct and a per-physical-slot route capacity Cr:
/// hidden and output rows [Ct, d], the route table [Ct, k] (expert ids,
/// gates, accepted mask) with its expert counts, and the step metadata
/// (valid tokens per rank, rank token offsets, valid routes per slot). A
/// step writes its valid rows and counts into them and runs the layer on
/// the whole bucket: the router sees Ct rows (the fixed shape), and every
/// padding row's routes are masked (expert -1, gate 0, not accepted) before
/// anything is planned, so no padding row gets an expert identity, reaches
/// an expert's rows or a combine.
///
/// Admission is one collective (an allgather of every rank's counts and
/// flags) evaluated in this order; the first that holds names the refusal:
///
///   phase_not_decode               a rank's rows are not decode rows
///   graph_key_mismatch             the layer's key is not the bucket's (GraphKey)
///   rank_token_capacity_exceeded   a rank has more than Ct valid tokens
///   expert_route_capacity_exceeded a physical slot gets more than Cr routes (summed over ranks)
///   stable_buffer_unavailable      the bucket's buffers were released or moved
///
/// otherwise the step replays on the bucket. A refused step runs the
/// ordinary variable path (MoELayer::forward / forward_routes on the
/// caller's rows, every row and route), and its record says why.
///
/// With Kokkos 3.4 (and on every backend today) the admitted step runs
/// uncaptured on the fixed buffers: it is the same sequence of kernels and
/// MPI calls on the same buffers every step. The step contains host-driven
/// MPI exchanges, which a Kokkos graph cannot hold; ServeRecord::capture
/// says "none".

#include <KokkosMoE_Layer.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace KokkosMoE {

/// \brief The phase of a batch's rows.
enum class Phase : int { prefill = 0, decode = 1 };

inline EnumTable<Phase> const& names_of(Phase) {
  static EnumTable<Phase> const t{"phase", {{Phase::prefill, "prefill"}, {Phase::decode, "decode"}}};
  return t;
}

/// \brief Why a step did not replay on the bucket (none: it did).
enum class Refusal : int {
  none = 0,
  phase_not_decode,
  graph_key_mismatch,
  rank_token_capacity_exceeded,
  expert_route_capacity_exceeded,
  stable_buffer_unavailable
};

inline EnumTable<Refusal> const& names_of(Refusal) {
  static EnumTable<Refusal> const t{"admission refusal", {
      {Refusal::none, "none"},
      {Refusal::phase_not_decode, "phase_not_decode"},
      {Refusal::graph_key_mismatch, "graph_key_mismatch"},
      {Refusal::rank_token_capacity_exceeded, "rank_token_capacity_exceeded"},
      {Refusal::expert_route_capacity_exceeded, "expert_route_capacity_exceeded"},
      {Refusal::stable_buffer_unavailable, "stable_buffer_unavailable"}}};
  return t;
}

/// \brief Capacities of a decode bucket.
struct BucketConfig {
  index_t rank_tokens = 0;  ///< Ct: valid tokens per rank per step
  index_t slot_routes = 0;  ///< Cr: routes per physical slot per step (all ranks together)
};

/// \brief What a replayed step depends on; any difference refuses the step.
/// Fields in a fixed order, each as text (its value on this rank).
struct GraphKey {
  std::vector<std::pair<std::string, std::string>> fields;

  bool operator==(GraphKey const& o) const { return fields == o.fields; }
  bool operator!=(GraphKey const& o) const { return !(*this == o); }
  /// \brief "name: this -> other" of the first differing field ("" when equal).
  std::string difference(GraphKey const& other) const {
    for (std::size_t i = 0; i < std::max(fields.size(), other.fields.size()); ++i) {
      std::string const a = i < fields.size() ? fields[i].second : "(none)";
      std::string const b = i < other.fields.size() ? other.fields[i].second : "(none)";
      std::string const name = i < fields.size() ? fields[i].first : other.fields[i].first;
      if (a != b) return name + ": bucket " + a + ", layer " + b;
    }
    return {};
  }
  /// \brief FNV-1a of every field (the same on every rank when the keys agree).
  std::uint64_t digest() const {
    std::uint64_t h = 1469598103934665603ull;
    for (auto const& [n, v] : fields)
      for (char c : n + "=" + v + ";") {
        h ^= static_cast<unsigned char>(c);
        h *= 1099511628211ull;
      }
    return h;
  }
};

/// \brief The key of a layer at given capacities: communicator identity (EP
/// group name, size, epoch), placement generation, checkpoint, d, k, dtypes,
/// dispatch descriptor (algorithm, transport, payloads, waves), runner
/// descriptor (kind, GEMM path, padded capacity), and the capacities.
template <class T, class E, class M>
GraphKey graph_key(MoELayer<T, E, M> const& layer, BucketConfig const& capacity) {
  auto const& c = layer.config();
  auto const& comms = layer.communicators();
  GraphKey k;
  auto add = [&](char const* n, std::string v) { k.fields.emplace_back(n, std::move(v)); };
  add("communicator", comms.ep().name() + "/" + std::to_string(comms.ep().size()) + "@epoch" + std::to_string(comms.epoch()));
  add("placement_generation", std::to_string(layer.placement().generation()));
  add("physical_slots", std::to_string(layer.placement().num_slots()));
  add("checkpoint", layer.checkpoint());
  add("d", std::to_string(c.hidden));
  add("k", std::to_string(c.router.top_k));
  add("dtypes", std::string(std::is_same<T, float>::value ? "fp32" : "bf16") + "/" + to_string(c.exchange.payload) + "/" +
                    to_string(c.exchange.return_payload));
  add("dispatch", to_string(c.exchange.algorithm) + "/" + to_string(c.exchange.transport) + "/waves" +
                      std::to_string(c.exchange.waves));
  add("runner", to_string(c.runner.kind) + "/" + to_string(c.runner.gemm_path) + "/C" + std::to_string(c.runner.capacity));
  add("rank_token_capacity", std::to_string(capacity.rank_tokens));
  add("slot_route_capacity", std::to_string(capacity.slot_routes));
  return k;
}

/// \brief Rows of one execution unit, over the whole EP group.
struct UnitCounts {
  index_t useful_tokens = 0;    ///< valid token rows
  index_t executed_tokens = 0;  ///< token slots the kernels ran (the bucket's P Ct when replayed)
  index_t padding_tokens = 0;   ///< executed_tokens - useful_tokens
  index_t routes = 0;           ///< accepted routes of the valid tokens
  index_t useful_rows = 0;      ///< routed expert rows with a route identity
  index_t executed_rows = 0;    ///< routed expert rows handed to the kernels
  UnitCounts& operator+=(UnitCounts const& o) {
    useful_tokens += o.useful_tokens;
    executed_tokens += o.executed_tokens;
    padding_tokens += o.padding_tokens;
    routes += o.routes;
    useful_rows += o.useful_rows;
    executed_rows += o.executed_rows;
    return *this;
  }
};

/// \brief One execution unit of a served step.
struct ServeRecord {
  Phase phase = Phase::decode;
  bool replayed = false;             ///< ran on the bucket
  Refusal refusal = Refusal::none;   ///< why not (none when replayed)
  std::string why;                   ///< the refusal's detail (which rank, slot or key field)
  std::string capture = "none";      ///< how the replayed step ran: "none" (uncaptured)
  UnitCounts counts;                 ///< over the EP group
  std::vector<index_t> rank_tokens;  ///< valid tokens per EP rank (global rank order)
  std::vector<index_t> rank_offsets; ///< first global token of each rank (exclusive scan)
  std::vector<index_t> slot_routes;  ///< routes per physical slot, summed over ranks
  StepRecord step;                   ///< this rank's layer record
};

/// \brief A mixed batch: one record per unit (prefill first, then decode),
/// and their sums.
struct MixedRecord {
  std::vector<ServeRecord> units;
  UnitCounts total;
};

/// \brief Bytes of one reserved buffer of a bucket (this rank).
struct ReservedBuffer {
  std::string name;
  std::int64_t bytes = 0;
};

/// \brief Fixed buffers of decode steps for one layer (see the file comment).
template <class T = float, class ExecutionSpace = Kokkos::DefaultExecutionSpace,
          class MemorySpace = typename ExecutionSpace::memory_space>
class DecodeBucket {
 public:
  using layer_type = MoELayer<T, ExecutionSpace, MemorySpace>;

  /// \brief Collective over the layer's EP group: allocates the buffers and
  /// records the layer's key. Bad capacities, or a router whose admission
  /// drops routes (padding rows would compete for capacity), are errors on
  /// every rank.
  DecodeBucket(layer_type const& layer, BucketConfig capacity) : capacity_(capacity) {
    auto const& c = layer.config();
    collective(layer.communicators().ep().comm(), "decode bucket", [&] {
      KOKKOSMOE_REQUIRE(capacity.rank_tokens >= 1, "decode bucket: rank token capacity " << capacity.rank_tokens << " must be >= 1");
      KOKKOSMOE_REQUIRE(capacity.slot_routes >= 1, "decode bucket: slot route capacity " << capacity.slot_routes << " must be >= 1");
      KOKKOSMOE_REQUIRE(c.router.admission.policy == AdmissionPolicy::dropless,
                        "decode bucket: the router's admission is " << to_string(c.router.admission.policy)
                                                                    << "; a bucket needs dropless routing (padding rows would "
                                                                       "compete for expert capacity)");
    }, c.exchange.watchdog_seconds);
    d_ = c.hidden;
    k_ = c.router.top_k;
    E_ = c.router.num_experts;
    S_ = layer.placement().num_slots();
    key_ = graph_key(layer, capacity_);
    reserve();
  }

  BucketConfig const& capacity() const { return capacity_; }
  GraphKey const& key() const { return key_; }
  /// \brief Re-records the key from a layer (a new placement generation or
  /// checkpoint the caller accepts; its slot count may differ); the buffers
  /// stay where they are, so d, k and the expert count must not change.
  /// Collective over the layer's EP group.
  void rebind(layer_type const& layer) {
    auto const& c = layer.config();
    collective(layer.communicators().ep().comm(), "decode bucket rebind", [&] {
      KOKKOSMOE_REQUIRE(c.hidden == d_ && c.router.top_k == k_ && c.router.num_experts == E_,
                        "decode bucket rebind: the layer has d " << c.hidden << ", k " << c.router.top_k << ", " << c.router.num_experts
                                                                 << " experts; the bucket's buffers are for d " << d_ << ", k " << k_
                                                                 << ", " << E_ << " experts");
    }, c.exchange.watchdog_seconds);
    S_ = layer.placement().num_slots();
    key_ = graph_key(layer, capacity_);
  }

  /// \brief Releases the buffers (steps are refused with
  /// stable_buffer_unavailable until reserve()).
  void release() {
    hidden_ = {};
    out_ = {};
    table_ = {};
    reserved_ = false;
  }
  /// \brief Allocates the buffers (construction does).
  void reserve() {
    hidden_ = RowMatrix<T, MemorySpace>("KokkosMoE::DecodeBucket::hidden", capacity_.rank_tokens, d_);
    out_ = RowMatrix<T, MemorySpace>("KokkosMoE::DecodeBucket::out", capacity_.rank_tokens, d_);
    table_ = RouteTable<MemorySpace>("KokkosMoE::DecodeBucket::routes", capacity_.rank_tokens, k_, E_);
    pointers_ = data_pointers();
    reserved_ = true;
  }
  bool reserved() const { return reserved_; }

  /// \brief The reserved payload of this rank, buffer by buffer.
  std::vector<ReservedBuffer> ledger() const {
    auto const Ct = capacity_.rank_tokens;
    std::int64_t const row = static_cast<std::int64_t>(d_) * static_cast<std::int64_t>(sizeof(T));
    std::vector<ReservedBuffer> v{{"hidden", Ct * row},
                                  {"out", Ct * row},
                                  {"route_expert", Ct * k_ * static_cast<std::int64_t>(sizeof(int))},
                                  {"route_gate", Ct * k_ * static_cast<std::int64_t>(sizeof(float))},
                                  {"route_accepted", Ct * k_ * static_cast<std::int64_t>(sizeof(std::uint8_t))},
                                  {"expert_counts", E_ * static_cast<std::int64_t>(sizeof(index_t))},
                                  {"step_metadata", static_cast<std::int64_t>(S_ + 1) * static_cast<std::int64_t>(sizeof(index_t))}};
    return v;
  }
  /// \brief The bucket's buffers (ledger()) and, after them, what the
  /// layer keeps between steps (MoELayer::held_buffers(), names prefixed
  /// "layer:"): the workspaces and exchange staging a replayed step reuses.
  /// Those are shared with the layer's ordinary steps and sized by the
  /// largest step so far; replays allocate none of them.
  std::vector<ReservedBuffer> step_ledger(layer_type const& layer) const {
    auto v = ledger();
    for (auto const& [name, bytes] : layer.held_buffers()) v.push_back({"layer:" + name, bytes});
    return v;
  }

  std::int64_t reserved_bytes() const {
    std::int64_t b = 0;
    for (auto const& r : ledger()) b += r.bytes;
    return b;
  }

  /// \brief One step of n = hidden.extent(0) rows of one phase on this rank,
  /// routed by the layer's router: replayed on the bucket when admitted,
  /// else the ordinary forward on the caller's rows. out [n, d] receives the
  /// output either way. Collective over the layer's EP group.
  ServeRecord step(ExecutionSpace const& exec, layer_type& layer, RowMatrix<T, MemorySpace> const& hidden,
                   RowMatrix<T, MemorySpace> const& out, Phase phase) {
    return run(exec, layer, hidden, nullptr, out, phase);
  }

  /// \brief step() on given routes (table [n, k]; its accepted mask is kept).
  ServeRecord step_routes(ExecutionSpace const& exec, layer_type& layer, RowMatrix<T, MemorySpace> const& hidden,
                          RouteTable<MemorySpace> const& table, RowMatrix<T, MemorySpace> const& out, Phase phase) {
    return run(exec, layer, hidden, &table, out, phase);
  }

  /// \brief A batch whose rows carry their phases (phase[i] of row i): the
  /// prefill rows run as one unit (ordinary path), then the decode rows as a
  /// bucket step; outputs land in their rows of out. Every rank runs both
  /// units (with its own, possibly zero, rows). Collective.
  MixedRecord serve(ExecutionSpace const& exec, layer_type& layer, RowMatrix<T, MemorySpace> const& hidden,
                    RowMatrix<T, MemorySpace> const& out, std::vector<Phase> const& phase) {
    index_t const n = static_cast<index_t>(hidden.extent(0));
    std::string problem = problem_of([&] {
      KOKKOSMOE_REQUIRE(static_cast<index_t>(phase.size()) == n,
                        "decode bucket: " << phase.size() << " phases for " << n << " rows");
      KOKKOSMOE_REQUIRE(out.extent(0) == hidden.extent(0) && out.extent(1) == hidden.extent(1),
                        "decode bucket: out is " << out.extent(0) << "x" << out.extent(1) << ", hidden " << hidden.extent(0) << "x"
                                                 << hidden.extent(1));
    });
    agree(layer.communicators().ep().comm(), problem, "decode bucket: mixed batch", layer.config().exchange.watchdog_seconds);
    MixedRecord m;
    for (Phase const p : {Phase::prefill, Phase::decode}) {
      std::vector<index_t> rows;
      for (index_t i = 0; i < n; ++i)
        if (phase[static_cast<std::size_t>(i)] == p) rows.push_back(i);
      auto const idx = scratch_copy(&work_, exec, std::string("rows_") + to_string(p), rows);
      auto const m_rows = static_cast<index_t>(rows.size());
      auto x = work_.template matrix<T>(exec, std::string("unit_hidden_") + to_string(p), m_rows, static_cast<std::size_t>(d_));
      auto y = work_.template matrix<T>(exec, std::string("unit_out_") + to_string(p), m_rows, static_cast<std::size_t>(d_));
      gather_rows(exec, hidden, idx, x, "KokkosMoE::DecodeBucket::split");
      m.units.push_back(run(exec, layer, x, nullptr, y, p));
      scatter_rows(exec, y, idx, out, "KokkosMoE::DecodeBucket::merge");
      m.total += m.units.back().counts;
    }
    Compat::fence(exec, "KokkosMoE::DecodeBucket::serve");
    return m;
  }

 private:
  std::vector<void const*> data_pointers() const {
    return {hidden_.data(), out_.data(), table_.expert.data(), table_.gate.data(), table_.accepted.data(), table_.expert_counts.data()};
  }

  ServeRecord run(ExecutionSpace const& exec, layer_type& layer, RowMatrix<T, MemorySpace> const& hidden,
                  RouteTable<MemorySpace> const* given, RowMatrix<T, MemorySpace> const& out, Phase phase) {
    auto const& comms = layer.communicators();
    MPI_Comm const ep = comms.ep().comm();
    double const watchdog = layer.config().exchange.watchdog_seconds;
    int const P = comms.ep().size();
    index_t const n = static_cast<index_t>(hidden.extent(0));
    index_t const Ct = capacity_.rank_tokens;
    ServeRecord rec;
    rec.phase = phase;
    // Local checks first (shapes), agreed by every rank.
    std::string problem = problem_of([&] {
      KOKKOSMOE_REQUIRE(static_cast<int>(hidden.extent(1)) == d_ && out.extent(0) == hidden.extent(0) &&
                            static_cast<int>(out.extent(1)) == d_,
                        "decode bucket: hidden is " << hidden.extent(0) << "x" << hidden.extent(1) << ", out " << out.extent(0) << "x"
                                                    << out.extent(1) << ", width " << d_);
      if (given)
        KOKKOSMOE_REQUIRE(given->num_tokens() == n && given->top_k() == k_,
                          "decode bucket: the route table is " << given->num_tokens() << "x" << given->top_k() << " for " << n
                                                               << " rows and top_k " << k_);
    });
    agree(ep, problem, "decode bucket step", watchdog);
    GraphKey const live = graph_key(layer, capacity_);
    bool const key_ok = live == key_;
    bool const buffers_ok = reserved_ && data_pointers() == pointers_;
    bool const phase_ok = phase == Phase::decode;
    bool const fits = n <= Ct;
    // Routes of the valid rows into the bucket's table (when they can be
    // there), padding masked; the per-slot counts feed the admission.
    std::vector<index_t> slots(static_cast<std::size_t>(S_), 0);
    bool const routed = phase_ok && key_ok && buffers_ok && fits;
    if (routed) {
      using range = std::pair<index_t, index_t>;
      Kokkos::deep_copy(exec, Kokkos::subview(hidden_, range(0, n), Kokkos::ALL), hidden);
      Kokkos::deep_copy(exec, Kokkos::subview(hidden_, range(n, Ct), Kokkos::ALL), from_float<T>(0.0f));
      if (given) {
        Kokkos::deep_copy(exec, Kokkos::subview(table_.expert, range(0, n), Kokkos::ALL), given->expert);
        Kokkos::deep_copy(exec, Kokkos::subview(table_.gate, range(0, n), Kokkos::ALL), given->gate);
        Kokkos::deep_copy(exec, Kokkos::subview(table_.accepted, range(0, n), Kokkos::ALL), given->accepted);
      } else {
        RouteOptions<MemorySpace> opts;
        opts.gemm_path = layer.config().router_gemm;
        layer.router().route(exec, hidden_, layer.router_weight(), table_, opts);
      }
      mask_padding(exec, n);
      slots = layer.slot_route_counts(exec, table_);
    }
    // One allgather: per rank its tokens, flags and per-slot routes.
    std::size_t const W = 4 + static_cast<std::size_t>(S_);
    std::vector<std::int64_t> mine(W, 0), all(W * static_cast<std::size_t>(P), 0);
    mine[0] = n;
    mine[1] = phase_ok ? 0 : 1;
    mine[2] = key_ok ? 0 : static_cast<std::int64_t>(live.digest() & 0x7FFFFFFFFFFFFFFFull) | 1;
    mine[3] = buffers_ok ? 0 : 1;
    for (int s = 0; s < S_; ++s) mine[4 + static_cast<std::size_t>(s)] = slots[static_cast<std::size_t>(s)];
    // (An allgather as a watched sum of every rank's row in its place: a
    // missing rank ends the step within the watchdog instead of hanging.)
    std::vector<std::int64_t> placed(all.size(), 0);
    std::copy(mine.begin(), mine.end(), placed.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(comms.ep().my_slot()) * W));
    allreduce_watched(placed.data(), all.data(), static_cast<int>(all.size()), MPI_INT64_T, MPI_SUM, ep, "decode bucket admission", watchdog);
    rec.rank_tokens.assign(static_cast<std::size_t>(P), 0);
    rec.rank_offsets.assign(static_cast<std::size_t>(P), 0);
    rec.slot_routes.assign(static_cast<std::size_t>(S_), 0);
    index_t useful = 0;
    for (int p = 0; p < P; ++p) {
      auto const* row = &all[static_cast<std::size_t>(p) * W];
      rec.rank_tokens[static_cast<std::size_t>(p)] = row[0];
      rec.rank_offsets[static_cast<std::size_t>(p)] = useful;
      useful += row[0];
      for (int s = 0; s < S_; ++s) rec.slot_routes[static_cast<std::size_t>(s)] += row[4 + s];
    }
    auto first_rank = [&](std::size_t field, auto pred) {
      for (int p = 0; p < P; ++p)
        if (pred(all[static_cast<std::size_t>(p) * W + field])) return comms.ep().global_rank(p);
      return -1;
    };
    auto set = [&](Refusal r, std::string why) {
      if (rec.refusal == Refusal::none) {
        rec.refusal = r;
        rec.why = std::move(why);
      }
    };
    if (int r = first_rank(1, [](std::int64_t v) { return v != 0; }); r >= 0)
      set(Refusal::phase_not_decode, "rank " + std::to_string(r) + "'s rows are not decode rows");
    if (int r = first_rank(2, [](std::int64_t v) { return v != 0; }); r >= 0)
      set(Refusal::graph_key_mismatch, "rank " + std::to_string(r) + ": " +
                                           (key_ok ? std::string("its layer's key differs from the bucket's") : key_.difference(live)));
    if (int r = first_rank(0, [&](std::int64_t v) { return v > Ct; }); r >= 0)
      set(Refusal::rank_token_capacity_exceeded, "rank " + std::to_string(r) + " has " +
                                                     std::to_string(all[static_cast<std::size_t>(comms.ep().slot_of(r)) * W]) +
                                                     " tokens, capacity " + std::to_string(Ct));
    for (int s = 0; s < S_ && rec.refusal == Refusal::none; ++s)
      if (rec.slot_routes[static_cast<std::size_t>(s)] > capacity_.slot_routes)
        set(Refusal::expert_route_capacity_exceeded, "physical slot " + std::to_string(s) + " (expert " +
                                                         std::to_string(layer.placement().slot(s).expert) + ") gets " +
                                                         std::to_string(rec.slot_routes[static_cast<std::size_t>(s)]) +
                                                         " routes, capacity " + std::to_string(capacity_.slot_routes));
    if (int r = first_rank(3, [](std::int64_t v) { return v != 0; }); r >= 0)
      set(Refusal::stable_buffer_unavailable, "rank " + std::to_string(r) + "'s bucket buffers were released or moved");

    rec.replayed = rec.refusal == Refusal::none;
    if (rec.replayed) {
      rec.step = layer.forward_routes(exec, hidden_, table_, out_);
      using range = std::pair<index_t, index_t>;
      Kokkos::deep_copy(exec, out, Kokkos::subview(out_, range(0, n), Kokkos::ALL));
      rec.counts.executed_tokens = static_cast<index_t>(P) * Ct;
    } else {
      rec.step = given ? layer.forward_routes(exec, hidden, *given, out) : layer.forward(exec, hidden, out);
      rec.counts.executed_tokens = useful;
    }
    rec.counts.useful_tokens = useful;
    rec.counts.padding_tokens = rec.counts.executed_tokens - useful;
    std::int64_t local[3] = {rec.step.routes.accepted, rec.step.experts.useful_rows, rec.step.experts.executed_rows}, sum[3] = {0, 0, 0};
    allreduce_watched(local, sum, 3, MPI_INT64_T, MPI_SUM, ep, "decode bucket counts", watchdog);
    rec.counts.routes = sum[0];
    rec.counts.useful_rows = sum[1];
    rec.counts.executed_rows = sum[2];
    Compat::fence(exec, "KokkosMoE::DecodeBucket::step");
    return rec;
  }

 public:
  /// Rows [n, Ct) of the bucket's table: no expert, no gate, not accepted;
  /// the expert counts and route counts are the valid rows'. (Public only
  /// because CUDA forbids extended lambdas in private members.)
  void mask_padding(ExecutionSpace const& exec, index_t n) {
    auto expert = table_.expert;
    auto gate = table_.gate;
    auto accepted = table_.accepted;
    int const k = k_;
    index_t const Ct = capacity_.rank_tokens;
    Kokkos::parallel_for(
        "KokkosMoE::DecodeBucket::mask_padding", Kokkos::RangePolicy<ExecutionSpace>(exec, n, Ct), KOKKOS_LAMBDA(index_t t) {
          for (int j = 0; j < k; ++j) {
            expert(t, j) = -1;
            gate(t, j) = 0.0f;
            accepted(t, j) = 0;
          }
        });
    Impl::route_histogram(exec, Ct, k, Impl::AcceptedExpertBin<MemorySpace>{expert, accepted}, table_.expert_counts);
    index_t acc = 0;
    Kokkos::parallel_reduce(
        "KokkosMoE::DecodeBucket::accepted", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, n),
        KOKKOS_LAMBDA(index_t t, index_t & a) {
          for (int j = 0; j < k; ++j) a += accepted(t, j) ? 1 : 0;
        },
        acc);
    table_.counts.attempted = n * k;
    table_.counts.accepted = acc;
    table_.counts.dropped = n * k - acc;
  }

 private:
  BucketConfig capacity_;
  int d_ = 0, k_ = 0, E_ = 0, S_ = 0;
  GraphKey key_;
  RowMatrix<T, MemorySpace> hidden_, out_;
  RouteTable<MemorySpace> table_;
  std::vector<void const*> pointers_;
  bool reserved_ = false;
  Workspace<MemorySpace> work_{"KokkosMoE::DecodeBucket"};
};

}  // namespace KokkosMoE

#endif
