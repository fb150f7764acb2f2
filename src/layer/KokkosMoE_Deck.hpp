#ifndef KOKKOSMOE_DECK_HPP
#define KOKKOSMOE_DECK_HPP

/// \file KokkosMoE_Deck.hpp
/// \brief TOML input decks of the mini-apps (documented key by key in
/// inputs/README.md). Rank 0 reads the file and broadcasts its text; every
/// rank parses the same text, so every rank raises the same error. An unknown
/// key, a wrong type, a value out of range or an inconsistent setting fails
/// before any work, naming file, line, column and key.

#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Fabric.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Gemm.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Placement.hpp>
#include <KokkosMoE_RouteTrace.hpp>
#include <KokkosMoE_Router.hpp>
#include <KokkosMoE_Safetensors.hpp>
#include <KokkosMoE_Schedule.hpp>
#include <KokkosMoE_Topology.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_Types.hpp>

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief One explicit route of a deck (fixtures).
struct DeckRoute {
  int token = 0;
  int k_slot = 0;
  int expert = 0;
  float gate = 0.0f;
  int slot = -1;  ///< physical slot, -1: chosen by the replica policy
};

/// \brief Explicit tokens of one rank.
struct DeckRankTokens {
  std::vector<std::vector<float>> hidden;  ///< [T][hidden]
  std::vector<DeckRoute> routes;
};

/// \brief One physical slot of an explicit placement.
struct DeckSlot {
  int expert = 0;
  int rank = 0;
};

/// \brief Everything a layer or exchange run reads from its deck.
struct LayerDeck {
  std::string path;  ///< file the deck came from
  std::string text;  ///< its text, as broadcast

  struct Run {
    int steps = 10;
    int warmup = 2;
    std::uint64_t seed = 1234;
    std::string report;           ///< JSON report path ("" none)
    std::string hdf5;             ///< HDF5 time series path ("" none)
    std::string record_routes;    ///< routes of every step to this trace ("" none; KokkosMoE_RouteTrace.hpp)
    bool record_logits = false;   ///< the trace holds the router's logits too (router runs, or logit replays)
    int progress_every = 0;       ///< steps between progress lines (0: about 10 lines per run)
    std::vector<KokkosMoE::Exchange::Algorithm> compare;  ///< algorithms run side by side on the same routes
    ScheduleKind schedule = ScheduleKind::serial;  ///< how a step's tasks overlap
    int chunks = 1;                                ///< token ranges of a chunked step
    std::string mode = "forward";                  ///< "forward", "train" (against a teacher, [train]) or "serve" ([serve])
  } run;

  /// [train]: run.mode = "train" (see KokkosMoE_Train.hpp).
  struct Train {
    std::string optimizer = "adam";    ///< "adam" or "sgd"
    double learning_rate = 1e-2;
    std::string schedule = "constant";  ///< "constant" or "cosine" (to 0 over the run's steps)
    std::uint64_t teacher_seed = 0;    ///< the teacher's weights (0: run.seed + 1)
    double balance_alpha = 0.0;        ///< Switch balance loss coefficient (0: none)
    std::string teacher_router = "student";  ///< "student": the teacher routes like the untrained student; "own"
    int gradient_block = 64;           ///< tokens per block of the reproducible gradient sums
    bool reproducible_shared = false;  ///< shared experts' gradients summed reproducibly too
    std::string products = "fp32";     ///< the experts' training GEMMs: "fp32" or "bf16" operands
  } train;

  /// [serve]: run.mode = "serve", steps on a decode bucket (KokkosMoE_Serve.hpp).
  struct Serve {
    index_t rank_tokens = 4;  ///< Ct: decode tokens per rank the bucket holds
    index_t slot_routes = 0;  ///< Cr: routes per physical slot per step (0: ranks * rank_tokens * top_k, never refusing)
    bool check = true;        ///< every step also runs the ordinary path; outputs must have its bits
    int repeat = 1;           ///< the step sequence runs this many times
    struct Step {
      std::vector<index_t> decode;   ///< decode rows per rank
      std::vector<index_t> prefill;  ///< prefill rows per rank, before the decode rows (a mixed batch)
    };
    std::vector<Step> steps;  ///< [[serve.step]] (default: decode steps of 1, 2, 4, ... rank_tokens rows)
  } serve;

  struct Model {
    int hidden = 64;
    int experts = 8;
    int top_k = 2;
    int ffn = 128;
    int shared_experts = 0;
    int shared_ffn = 128;
    std::string dtype = "fp32";               ///< hidden rows and weights: fp32 or bf16
    PayloadType payload = PayloadType::bf16;  ///< dispatch rows on the wire
    PayloadType return_payload = PayloadType::bf16;  ///< combine rows on the wire
    /// A Hugging Face checkpoint (a directory with config.json and
    /// safetensors files, single or sharded) whose MoE layer `layer` the
    /// layer runs: sizes and routing from config.json, every weight from
    /// the safetensors ("" : seeded weights).
    std::string checkpoint;
    int layer = -1;
    Checkpoint::HFMoELayer hf;  ///< config.json's layer (with checkpoint)
  } model;

  RouterConfig router;              ///< num_experts/top_k filled from [model]
  std::string domain_limit = "none";  ///< none, rank or node (expert_domain set by the layer)
  GemmPath router_gemm = GemmPath::automatic;
  std::string bias_update = "none";   ///< none, sign or proportional
  double bias_gamma = 0.001;

  struct Tokens {
    index_t per_rank = 64;
    std::string source = "router";  ///< router, uniform, zipf, hot, explicit, trace
    std::string trace;              ///< source "trace": routes to replay (KokkosMoE_RouteTrace.hpp)
    TraceReplay replay = TraceReplay::automatic;  ///< source "trace": its routes, or its logits through the router
    double zipf_s = 1.2;
    int hot_expert = 0;
    double hot_fraction = 0.5;
    std::vector<DeckRankTokens> ranks;  ///< explicit: one entry per rank
  } tokens;

  struct Topology {
    KokkosMoE::Topology::LayoutKind layout = KokkosMoE::Topology::LayoutKind::virtual_nodes;
    int nodes = 0;           ///< virtual nodes (rank r on node r * nodes / ranks), at most one per rank
    int ranks_per_node = 0;
    std::vector<int> node_of_rank;
    std::vector<std::string> nics;
    std::string synthetic;
    std::string xml;
    std::vector<int> peer_order;
    int relays_per_node = 1;
    KokkosMoE::Topology::RelayPolicy relay_policy = KokkosMoE::Topology::RelayPolicy::lowest_local_rank;
    /// [topology.fabric]: an emulated fabric on a virtual layout (off unless
    /// inter_bandwidth_gbps > 0; see KokkosMoE_Exchange_Fabric.hpp).
    KokkosMoE::Exchange::FabricSpec fabric;
  } topology;

  struct Placement {
    PlacementPolicy policy = PlacementPolicy::round_robin;
    int physical_slots = 0;              ///< EPLB: total slots (0: experts)
    int groups = 1;                      ///< EPLB expert groups
    std::vector<double> loads;           ///< EPLB: per-expert load (empty: from load_file, else uniform)
    std::string load_file;               ///< EPLB: load file (kmoe-eplb formats)
    int rebalance_every = 0;             ///< EPLB: rebuild the placement from every N steps' observed load (0: never)
    ReplicaPolicy replica_policy = ReplicaPolicy::locality;
    std::vector<DeckSlot> slots;         ///< explicit
  } placement;

  struct Exchange {
    KokkosMoE::Exchange::Algorithm algorithm = KokkosMoE::Exchange::Algorithm::flat;
    KokkosMoE::Exchange::TransportKind transport = KokkosMoE::Exchange::TransportKind::mpi;
    double watchdog_seconds = 300.0;
    bool verify_send_rows = false;  ///< check started transfers' send rows at completion
    bool stage_through_host = false;  ///< MPI: rows through host copies even where MPI reads the buffers
    bool pair_runs = false;           ///< MPI: sends and receives paired as NCCL pairs them
    bool receive_into_experts = true;  ///< flat: rows straight to and from their expert-major places
    /// The hierarchical exchange deduplicates per node: "hierarchical" in
    /// exchange.algorithm and run.compare means hierarchical_dedup.
    bool node_dedup = false;
    int waves = 1;
    double sender_cf = 1.25;
    double receiver_cf = 1.5;
  } exchange;

  struct Experts {
    KokkosMoE::Experts::RunnerKind runner = KokkosMoE::Experts::RunnerKind::grouped;
    index_t capacity = 0;
    index_t alignment = 1;
    index_t block_size = 128;
    GemmPath gemm = GemmPath::automatic;
    KokkosMoE::Experts::GroupedKernel kernel = KokkosMoE::Experts::GroupedKernel::automatic;  ///< grouped and block runners
    int decode_rows = -1;  ///< host decode kernel up to this many rows per tile (-1: library default, 0: never)
    std::string weights;       ///< HDF5 file to load ("" random from the seed)
    std::string save_weights;  ///< HDF5 file to write after initialisation ("" none)
    std::vector<float> scales; ///< scalar runner: scale of every logical expert
  } experts;

  struct Simulate {
    int ranks = 0;  ///< kmoe-exchange simulate mode: simulated ranks
  } simulate;

  /// \brief The resolved configuration as TOML (every key, defaults included).
  std::string resolved() const;
};

/// \brief Parses deck text for a run on nranks ranks. Pure (no MPI): throws
/// Error "<path>:<line>:<column>: key '<table.key>': <problem>".
LayerDeck parse_layer_deck(std::string const& path, std::string const& text, int nranks);

/// \brief Collective over comm: rank 0 reads path and broadcasts the text,
/// every rank parses it. Any error (missing file included) is raised as the
/// same CollectiveError on every rank.
LayerDeck read_layer_deck(MPI_Comm comm, std::string const& path);

}  // namespace KokkosMoE

#endif
