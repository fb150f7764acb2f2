#ifndef KOKKOSMOE_LAYERSETUP_HPP
#define KOKKOSMOE_LAYERSETUP_HPP

/// \file KokkosMoE_LayerSetup.hpp
/// \brief From a deck to the objects of a run: topology and communicator
/// specs, the placement, the layer configuration, deterministic synthetic
/// tokens (hidden rows and route tables that depend only on the seed, the
/// step and the global token index, never on the rank count), router and
/// expert weights. Used by the mini-apps and by the tests that compare a
/// distributed run with a single-rank one.

#include <KokkosMoE_Admission.hpp>
#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Layer.hpp>
#include <KokkosMoE_PlacementIO.hpp>
#include <KokkosMoE_RouteTrace.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <vector>

namespace KokkosMoE {
namespace Setup {

/// \brief Counter-based uniform value in [0, 1) from four integers.
inline double hash_uniform(std::uint64_t seed, std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL + a * 0xBF58476D1CE4E5B9ULL + b * 0x94D049BB133111EBULL + c + 0x632BE59BD9B4E019ULL;
  for (int i = 0; i < 2; ++i) {
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ULL;
    x ^= x >> 32;
  }
  return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);
}

inline Topology::LayoutSpec layout_spec(LayerDeck const& d) {
  Topology::LayoutSpec s;
  s.kind = d.topology.layout;
  s.ranks_per_node = d.topology.ranks_per_node;
  s.node_of_rank = d.topology.node_of_rank;
  s.nic_names = d.topology.nics;
  s.synthetic = d.topology.synthetic;
  s.xml_file = d.topology.xml;
  return s;
}

inline Topology::CommSpec comm_spec(LayerDeck const& d) {
  Topology::CommSpec s;
  s.peer_order = d.topology.peer_order;
  s.relays_per_node = d.topology.relays_per_node;
  s.relay_policy = d.topology.relay_policy;
  return s;
}

/// \brief The deck's placement on `ranks` ranks with the given node of every
/// rank. Collective over comm only for EPLB loads read from a file.
inline Placement make_placement(LayerDeck const& d, std::vector<int> const& node_of_rank, MPI_Comm comm) {
  int const ranks = static_cast<int>(node_of_rank.size());
  int const E = d.model.experts;
  auto const& p = d.placement;
  if (p.policy == PlacementPolicy::round_robin) return Placement::round_robin(E, ranks, node_of_rank);
  if (p.policy == PlacementPolicy::contiguous) return Placement::contiguous(E, ranks, node_of_rank);
  if (p.policy == PlacementPolicy::explicit_slots) {
    std::vector<SlotInfo> slots;
    for (auto const& s : p.slots) {
      SlotInfo si;
      si.expert = s.expert;
      si.rank = s.rank;
      slots.push_back(si);
    }
    return Placement(E, ranks, slots, node_of_rank);
  }
  std::vector<double> load = p.loads;
  if (load.empty() && !p.load_file.empty()) {
    auto const m = read_load_matrix(comm, p.load_file);
    KOKKOSMOE_REQUIRE(!m.empty() && static_cast<int>(m[0].size()) == E,
                      "load file '" << p.load_file << "' has " << (m.empty() ? 0 : m[0].size()) << " experts, the deck " << E);
    load = m[0];
  }
  if (load.empty()) load.assign(static_cast<std::size_t>(E), 1.0);
  PlacementSpec spec;
  spec.policy = p.policy;
  spec.physical_slots = p.physical_slots;
  spec.groups = p.groups;
  spec.nodes = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
  spec.ranks = ranks;
  auto lp = eplb_layer(load, spec);
  return lp.placement.with_nodes(node_of_rank);
}

/// \brief Tokens per rank of a deck (explicit decks: the largest rank's).
inline index_t tokens_per_rank(LayerDeck const& d) {
  if (d.tokens.source != "explicit") return d.tokens.per_rank;
  index_t t = 0;
  for (auto const& r : d.tokens.ranks) t = std::max<index_t>(t, static_cast<index_t>(r.hidden.size()));
  return t;
}

/// \brief Exchange configuration of a deck: algorithm, transport, wire
/// payloads, watchdog and the pooled-wave shape.
inline Exchange::ExchangeConfig exchange_config(LayerDeck const& d) {
  Exchange::ExchangeConfig c;
  c.algorithm = d.exchange.algorithm;
  c.transport = d.exchange.transport;
  c.payload = d.model.payload;
  c.return_payload = d.model.return_payload;
  c.watchdog_seconds = d.exchange.watchdog_seconds;
  c.verify_send_rows = d.exchange.verify_send_rows;
  c.stage_through_host = d.exchange.stage_through_host;
  c.pair_runs = d.exchange.pair_runs;
  c.receive_into_experts = d.exchange.receive_into_experts;
  c.waves = d.exchange.waves;
  c.sender_cf = d.exchange.sender_cf;
  c.receiver_cf = d.exchange.receiver_cf;
  c.tokens_per_rank = tokens_per_rank(d);
  c.top_k = d.model.top_k;
  return c;
}

/// \brief Layer configuration of a deck on the given placement (domain maps
/// and device maps come from the placement).
inline LayerConfig layer_config(LayerDeck const& d, Placement const& placement) {
  LayerConfig c;
  c.hidden = d.model.hidden;
  c.router = d.router;
  if (d.domain_limit != "none") c.router.expert_domain = expert_domains(placement, d.domain_limit == "node");
  if (c.router.admission.policy == AdmissionPolicy::device_capacity) {
    c.router.admission.num_devices = placement.num_ranks();
    c.router.admission.expert_device = expert_domains(placement, false);
  }
  c.router_gemm = d.router_gemm;
  c.runner.kind = d.experts.runner;
  c.runner.capacity = d.experts.capacity;
  c.runner.alignment = d.experts.alignment;
  c.runner.block_size = d.experts.block_size;
  c.runner.gemm_path = d.experts.gemm;
  c.runner.grouped_kernel = d.experts.kernel;
  c.runner.decode_rows = d.experts.decode_rows;
  c.shared_runner = c.runner;
  if (c.shared_runner.kind == Experts::RunnerKind::scalar || c.shared_runner.kind == Experts::RunnerKind::padded ||
      c.shared_runner.kind == Experts::RunnerKind::block)
    c.shared_runner.kind = Experts::RunnerKind::grouped;
  c.exchange = exchange_config(d);
  c.replica_policy = d.placement.replica_policy;
  c.schedule.kind = d.run.schedule;
  c.schedule.chunks = d.run.chunks;
  c.backward_products = from_string<Experts::BackwardProducts>(d.train.products);
  return c;
}

/// \brief The distributed objects of a run: topology, communicator set,
/// node of every rank, placement and layer configuration.
struct Run {
  Topology::Topology topology;
  std::unique_ptr<Topology::CommunicatorSet> comms;
  std::vector<int> node_of_rank;
  Placement placement;
  LayerConfig config;
};

/// \brief Collective over comm: discovers (or declares) the deck's topology,
/// builds the communicator set, the placement and the layer configuration.
/// Errors reach every rank.
inline Run make_run(LayerDeck const& deck, MPI_Comm comm) {
  Run run;
  run.topology = Topology::Topology::discover(comm, layout_spec(deck));
  run.comms = std::make_unique<Topology::CommunicatorSet>(comm, run.topology, comm_spec(deck));
  for (int r = 0; r < run.topology.size(); ++r) run.node_of_rank.push_back(run.topology.node_of(r));
  collective(comm, "placement and layer configuration", [&] {
    run.placement = make_placement(deck, run.node_of_rank, comm);
    run.config = layer_config(deck, run.placement);
    KOKKOSMOE_REQUIRE(!deck.topology.fabric.enabled() || deck.exchange.transport == Exchange::TransportKind::mpi,
                      deck.path << ": [topology.fabric] emulates links in the MPI transport; exchange.transport is "
                                << to_string(deck.exchange.transport));
  });
  if (deck.topology.fabric.enabled())
    run.config.exchange.fabric = std::make_shared<Exchange::FabricEmulator>(comm, run.node_of_rank, deck.topology.fabric);
  return run;
}

/// \brief Layer configuration of a run's deck on another placement (a
/// rebalanced generation): the run's emulated fabric is kept.
inline LayerConfig layer_config(LayerDeck const& d, Run const& run, Placement const& placement) {
  LayerConfig c = layer_config(d, placement);
  c.exchange.fabric = run.config.exchange.fabric;
  return c;
}

namespace Impl {
/// Copies a checkpoint tensor (FP32, row-major, `n` values) into slot q of
/// a host [L, rows, cols] tensor, or into a host [rows, cols] matrix (q < 0).
template <class H>
void put_tensor(H const& h, int q, std::vector<float> const& v) {
  using T = typename H::non_const_value_type;
  if constexpr (H::rank == 3) {
    std::size_t const rows = h.extent(1), cols = h.extent(2);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) h(q, i, j) = from_float<T>(v[i * cols + j]);
  } else {
    std::size_t const rows = h.extent(0), cols = h.extent(1);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) h(i, j) = from_float<T>(v[i * cols + j]);
  }
}

/// SwiGLU weights of logical expert e of `hf` (gate, up, down) into slot q.
template <class T, class MS>
void load_expert(Checkpoint::SafetensorsCheckpoint const& ck, std::string const& gate, std::string const& up, std::string const& down,
                 Experts::ExpertWeights<T, MS> const& w, int q,
                 typename Experts::ExpertWeights<T, MS>::tensor_type::HostMirror const& hg,
                 typename Experts::ExpertWeights<T, MS>::tensor_type::HostMirror const& hu,
                 typename Experts::ExpertWeights<T, MS>::tensor_type::HostMirror const& hd) {
  std::int64_t const D = w.d(), F = w.d_ff();
  put_tensor(hg, q, ck.read_f32(gate, {F, D}));
  put_tensor(hu, q, ck.read_f32(up, {F, D}));
  put_tensor(hd, q, ck.read_f32(down, {D, F}));
}
}  // namespace Impl

/// \brief [E, d] router weight: the checkpoint's (model.checkpoint), or
/// element (e, c) = (2u - 1) / sqrt(d), u from (seed, e, c). The same on
/// every rank (a checkpoint's error is every rank's).
template <class T, class MS>
RowMatrix<T, MS> router_weight(LayerDeck const& d) {
  int const E = d.model.experts, D = d.model.hidden;
  RowMatrix<T, MS> w("KokkosMoE::Setup::router_weight", E, D);
  auto h = Kokkos::create_mirror_view(w);
  if (!d.model.checkpoint.empty()) {
    Checkpoint::SafetensorsCheckpoint ck(d.model.checkpoint);
    Impl::put_tensor(h, -1, ck.read_f32(d.model.hf.router_weight, {E, D}));
    Kokkos::deep_copy(w, h);
    return w;
  }
  double const scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int e = 0; e < E; ++e)
    for (int c = 0; c < D; ++c)
      h(e, c) = from_float<T>(static_cast<float>((2.0 * hash_uniform(d.run.seed, 0x5254u, static_cast<std::uint64_t>(e), static_cast<std::uint64_t>(c)) - 1.0) * scale));
  Kokkos::deep_copy(w, h);
  return w;
}

/// \brief Routed expert weights of `rank`'s slots of `placement` (random
/// from the seed, loaded from the deck's HDF5 file for communicator epoch
/// `epoch` and the placement's generation, or scalar test experts). The
/// weights of a slot depend only on its logical expert, whatever the placement.
template <class T, class MS, class Exec>
Experts::ExpertWeights<T, MS> routed_weights(Exec const& exec, LayerDeck const& d, Placement const& placement, std::uint64_t epoch,
                                             int rank, MPI_Comm comm) {
  std::vector<int> slot_expert;
  for (int s : placement.slots_of_rank(rank)) slot_expert.push_back(placement.slot(s).expert);
  if (d.experts.runner == Experts::RunnerKind::scalar)
    return Experts::ExpertWeights<T, MS>::scalar("KokkosMoE::routed", slot_expert, d.model.hidden, d.experts.scales);
  Experts::ExpertWeights<T, MS> w("KokkosMoE::routed", slot_expert, d.model.hidden, d.model.ffn);
  if (!d.model.checkpoint.empty()) {
    // Each rank reads the experts of its slots only (replicas read theirs
    // again); a missing or bad tensor on any rank fails every rank.
    collective(comm, "loading the routed experts of model.checkpoint", [&] {
      Checkpoint::SafetensorsCheckpoint ck(d.model.checkpoint);
      auto hg = Kokkos::create_mirror_view(w.gate());
      auto hu = Kokkos::create_mirror_view(w.up());
      auto hd = Kokkos::create_mirror_view(w.down());
      auto const& hf = d.model.hf;
      for (int q = 0; q < w.num_slots(); ++q) {
        int const e = slot_expert[static_cast<std::size_t>(q)];
        Impl::load_expert(ck, hf.expert_gate(e), hf.expert_up(e), hf.expert_down(e), w, q, hg, hu, hd);
      }
      Kokkos::deep_copy(w.gate(), hg);
      Kokkos::deep_copy(w.up(), hu);
      Kokkos::deep_copy(w.down(), hd);
    });
    w.set_version(1);
    w.refresh_digests();
  } else if (d.experts.weights.empty())
    w.randomize(exec, d.run.seed);
  else
    w.load(comm, d.experts.weights, Experts::LoadContext{epoch, placement.generation()});
  if (!d.experts.save_weights.empty()) w.save(comm, d.experts.save_weights, d.model.experts);
  return w;
}

/// \brief routed_weights() for the run's placement and communicator epoch.
template <class T, class MS, class Exec>
Experts::ExpertWeights<T, MS> routed_weights(Exec const& exec, LayerDeck const& d, Run const& run, int rank, MPI_Comm comm) {
  return routed_weights<T, MS>(exec, d, run.placement, run.comms->epoch(), rank, comm);
}

/// \brief Shared expert weights (ids E, E+1, ... so they differ from routed ones).
template <class T, class MS, class Exec>
std::optional<Experts::ExpertWeights<T, MS>> shared_weights(Exec const& exec, LayerDeck const& d) {
  if (d.model.shared_experts == 0) return {};
  std::vector<int> ids;
  for (int s = 0; s < d.model.shared_experts; ++s) ids.push_back(d.model.experts + s);
  Experts::ExpertWeights<T, MS> w("KokkosMoE::shared", ids, d.model.hidden, d.model.shared_ffn);
  if (!d.model.checkpoint.empty()) {
    // The checkpoint's shared MLP (n_shared_experts x moe_intermediate_size wide) as one shared expert.
    Checkpoint::SafetensorsCheckpoint ck(d.model.checkpoint);
    auto hg = Kokkos::create_mirror_view(w.gate());
    auto hu = Kokkos::create_mirror_view(w.up());
    auto hd = Kokkos::create_mirror_view(w.down());
    Impl::load_expert(ck, d.model.hf.shared_gate, d.model.hf.shared_up, d.model.hf.shared_down, w, 0, hg, hu, hd);
    Kokkos::deep_copy(w.gate(), hg);
    Kokkos::deep_copy(w.up(), hu);
    Kokkos::deep_copy(w.down(), hd);
    w.set_version(1);
    w.refresh_digests();
    return w;
  }
  w.randomize(exec, d.run.seed ^ 0x5348415245ULL);
  return w;
}

/// \brief The checkpoint's correction bias (DeepSeek-V3's
/// e_score_correction_bias) into a layer's router; nothing without a
/// checkpoint or a bias.
template <class MS, class Exec>
void load_correction_bias(Exec const& exec, LayerDeck const& d, Router<MS>& router) {
  if (d.model.checkpoint.empty() || d.model.hf.router_bias.empty()) return;
  Checkpoint::SafetensorsCheckpoint ck(d.model.checkpoint);
  auto const b = ck.read_f32(d.model.hf.router_bias, {d.model.experts});
  auto bias = router.correction_bias();
  auto h = Kokkos::create_mirror_view(bias);
  for (int e = 0; e < d.model.experts; ++e) h(e) = b[static_cast<std::size_t>(e)];
  Kokkos::deep_copy(exec, bias, h);
  exec.fence();
}

/// \brief Global index of this rank's first token (ranks own tokens_per_rank
/// tokens each, in rank order).
inline index_t first_token(LayerDeck const& d, int rank) { return static_cast<index_t>(rank) * tokens_per_rank(d); }

/// \brief Number of hidden rows of `rank` for a step: `count`, or the
/// explicit deck's rows of that rank.
inline index_t hidden_row_count(LayerDeck const& d, index_t count, int rank) {
  return d.tokens.source == "explicit" ? static_cast<index_t>(d.tokens.ranks.at(static_cast<std::size_t>(rank)).hidden.size()) : count;
}

/// \brief Writes the hidden rows of a step into m ([hidden_row_count, d]):
/// element (t, c) = 2u - 1 from (seed, step, first + t, c); explicit decks
/// give the rows of `rank`. Steps that reuse m allocate nothing.
template <class T, class MS>
void hidden_rows_into(LayerDeck const& d, int step, index_t first, RowMatrix<T, MS> const& m, int rank) {
  int const D = d.model.hidden;
  index_t const count = static_cast<index_t>(m.extent(0));
  KOKKOSMOE_REQUIRE(count == hidden_row_count(d, count, rank) && static_cast<int>(m.extent(1)) == D,
                    "hidden rows: a " << m.extent(0) << "x" << m.extent(1) << " matrix for " << hidden_row_count(d, count, rank)
                                      << " rows of width " << D);
  bool const given = d.tokens.source == "explicit";
  std::vector<T> h(static_cast<std::size_t>(count) * static_cast<std::size_t>(D));
  for (index_t t = 0; t < count; ++t)
    for (int c = 0; c < D; ++c) {
      float const x = given ? d.tokens.ranks.at(static_cast<std::size_t>(rank)).hidden[static_cast<std::size_t>(t)][static_cast<std::size_t>(c)]
                            : static_cast<float>(2.0 * hash_uniform(d.run.seed, static_cast<std::uint64_t>(step) + 1,
                                                                    static_cast<std::uint64_t>(first + t), static_cast<std::uint64_t>(c)) -
                                                 1.0);
      h[static_cast<std::size_t>(t) * static_cast<std::size_t>(D) + static_cast<std::size_t>(c)] = from_float<T>(x);
    }
  Kokkos::deep_copy(m, Kokkos::View<T const**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
                           h.data(), static_cast<std::size_t>(count), static_cast<std::size_t>(D)));
}

/// \brief Hidden rows of `count` tokens starting at global token `first` for
/// a step (hidden_rows_into a new matrix).
template <class T, class MS>
RowMatrix<T, MS> hidden_rows(LayerDeck const& d, int step, index_t first, index_t count, int rank) {
  RowMatrix<T, MS> m("KokkosMoE::Setup::hidden", hidden_row_count(d, count, rank), d.model.hidden);
  hidden_rows_into(d, step, first, m, rank);
  return m;
}

/// \brief "<deck>: tokens.trace '<path>'", for messages about the deck's trace.
inline std::string trace_where(LayerDeck const& d) { return d.path + ": tokens.trace '" + d.tokens.trace + "'"; }

/// \brief Collective over comm: the deck's trace (tokens.source = "trace"),
/// checked against the deck and the run's rank count for the deck's
/// tokens.replay; errors on every rank.
inline RouteTrace load_trace(LayerDeck const& d, MPI_Comm comm) {
  auto t = read_route_trace(comm, d.tokens.trace);
  int const ranks = comm_size(comm);
  collective(comm, "route trace", [&] {
    check_route_trace(t, trace_where(d), ranks, d.model.top_k, d.model.experts, d.tokens.per_rank, d.tokens.replay);
  });
  return t;
}

/// \brief A route table drawn from the deck's token distribution (uniform,
/// zipf, hot) or its explicit routes, for `count` tokens from global token
/// `first` at a step; admission per the deck's router settings. Explicit
/// physical slots go to explicit_slot (empty when the deck gives none).
template <class MS, class Exec>
RouteTable<MS> sampled_routes(Exec const& exec, LayerDeck const& d, LayerConfig const& config, int step, index_t first,
                              index_t count, int rank, Kokkos::View<int**, Kokkos::LayoutRight, MS>& explicit_slot) {
  KOKKOSMOE_REQUIRE(d.tokens.source != "trace", d.path << ": tokens.source = \"trace\" replays recorded routes (Setup::load_trace and "
                                                            "trace_routes; kmoe-layer and kmoe-exchange), it is not a distribution to draw from");
  int const E = d.model.experts, k = d.model.top_k;
  bool const expl = d.tokens.source == "explicit";
  index_t const T = expl ? static_cast<index_t>(d.tokens.ranks.at(static_cast<std::size_t>(rank)).hidden.size()) : count;
  RouteTable<MS> table("KokkosMoE::Setup::routes", T, k, E);
  auto he = Kokkos::create_mirror_view(table.expert);
  auto hg = Kokkos::create_mirror_view(table.gate);
  auto ha = Kokkos::create_mirror_view(table.accepted);
  explicit_slot = {};
  if (expl) {
    auto const& routes = d.tokens.ranks.at(static_cast<std::size_t>(rank)).routes;
    // Per route: its slot when the deck gives one, else (-1) the replica policy's.
    bool slots = false;
    for (auto const& r : routes) slots = slots || r.slot >= 0;
    Kokkos::View<int**, Kokkos::LayoutRight, MS> es;
    if (slots) es = Kokkos::View<int**, Kokkos::LayoutRight, MS>("KokkosMoE::Setup::explicit_slot", T, k);
    auto hs = Kokkos::create_mirror_view(es);
    if (slots) Kokkos::deep_copy(hs, -1);
    for (auto const& r : routes) {
      he(r.token, r.k_slot) = r.expert;
      hg(r.token, r.k_slot) = r.gate;
      ha(r.token, r.k_slot) = 1;
      if (slots) hs(r.token, r.k_slot) = r.slot;
    }
    if (slots) {
      Kokkos::deep_copy(es, hs);
      explicit_slot = es;
    }
  } else {
    // Zipf: probability of expert perm[i] proportional to 1 / (i + 1)^s,
    // perm a seeded permutation so the hot experts are spread over ranks.
    std::vector<int> perm(static_cast<std::size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = E - 1; i > 0; --i)
      std::swap(perm[static_cast<std::size_t>(i)],
                perm[static_cast<std::size_t>(hash_uniform(d.run.seed, 0x5A49u, static_cast<std::uint64_t>(i), 0) * (i + 1))]);
    std::vector<double> cdf(static_cast<std::size_t>(E));
    double acc = 0;
    for (int i = 0; i < E; ++i) cdf[static_cast<std::size_t>(i)] = (acc += 1.0 / std::pow(i + 1.0, d.tokens.zipf_s));
    for (auto& c : cdf) c /= acc;
    std::vector<char> used(static_cast<std::size_t>(E));
    for (index_t t = 0; t < T; ++t) {
      std::fill(used.begin(), used.end(), 0);
      std::uint64_t const g = static_cast<std::uint64_t>(first + t);
      double gsum = 0;
      for (int j = 0; j < k; ++j) {
        int e = -1;
        for (int attempt = 0; attempt < 64 && e < 0; ++attempt) {
          double const u = hash_uniform(d.run.seed, static_cast<std::uint64_t>(step) + 1, g, static_cast<std::uint64_t>(j * 64 + attempt));
          int cand;
          if (d.tokens.source == "zipf") {
            cand = perm[static_cast<std::size_t>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin())];
          } else if (d.tokens.source == "hot" && j == 0 &&
                     hash_uniform(d.run.seed, 0x484Fu, g, static_cast<std::uint64_t>(step)) < d.tokens.hot_fraction) {
            cand = d.tokens.hot_expert;
          } else {
            cand = std::min(E - 1, static_cast<int>(u * E));
          }
          if (!used[static_cast<std::size_t>(cand)]) e = cand;
        }
        for (int x = 0; e < 0; ++x)  // rare: fall back to the lowest unused id
          if (!used[static_cast<std::size_t>(x)]) e = x;
        used[static_cast<std::size_t>(e)] = 1;
        he(t, j) = e;
        double const w = 0.25 + hash_uniform(d.run.seed, 0x4741u + static_cast<std::uint64_t>(step), g, static_cast<std::uint64_t>(j));
        hg(t, j) = static_cast<float>(w);
        gsum += w;
        ha(t, j) = 1;
      }
      for (int j = 0; j < k; ++j) hg(t, j) = static_cast<float>(hg(t, j) / gsum);
    }
  }
  Kokkos::deep_copy(table.expert, he);
  Kokkos::deep_copy(table.gate, hg);
  Kokkos::deep_copy(table.accepted, ha);
  // Admission with the gate as priority (the router's policy and capacity).
  admit(exec, config.router.admission, table);
  return table;
}

}  // namespace Setup
}  // namespace KokkosMoE

#endif
