// The C interface (kmoe.h) over the C++ layer: every entry point catches
// every exception, keeps its message for kmoe_last_error(), and returns a
// status. Collective entry points check their arguments on every rank and
// agree on the outcome before any collective work, so a problem on one rank
// is the same error on all of them.

#include <kmoe.h>

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_DeviceRuntime.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Experts_ReplicaGradients.hpp>
#include <KokkosMoE_Layer.hpp>
#include <KokkosMoE_LayerParameters.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Version.hpp>
#include <KokkosMoE_config.hpp>

#include <Kokkos_Core.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

namespace {

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using json = nlohmann::json;

thread_local std::string last_error;
bool started_mpi = false;
bool started_kokkos = false;
bool initialized = false;

/// A failure with the status the C caller gets.
struct Failure {
  kmoe_status status;
  std::string message;
};

/// Runs f, turning every exception into a status and the last error (a
/// library exception from phase `phase`: KMOE_ERROR_INPUT while reading and
/// building, KMOE_ERROR_RUNTIME while running).
template <class F>
kmoe_status guarded(kmoe_status phase, F&& f) {
  try {
    std::forward<F>(f)();
    last_error.clear();
    return KMOE_SUCCESS;
  } catch (Failure const& e) {
    last_error = e.message;
    return e.status;
  } catch (std::exception const& e) {
    last_error = e.what();
    return phase;
  } catch (...) {
    last_error = "unknown exception";
    return phase;
  }
}

[[noreturn]] void fail(kmoe_status s, std::string message) { throw Failure{s, std::move(message)}; }

void require_initialized(char const* call) {
  if (!initialized)
    fail(KMOE_ERROR_NOT_INITIALIZED, std::string(call) + ": KokkosMoE is not initialized (call kmoe_initialize first)");
}

/// Collective over comm: every rank's argument problem ("" for none);
/// any problem becomes the same KMOE_ERROR_INVALID_ARGUMENT on every rank.
void agree_arguments(MPI_Comm comm, std::string const& problem, char const* call, double watchdog) {
  try {
    agree(comm, problem, call, watchdog);
  } catch (std::exception const& e) {
    fail(KMOE_ERROR_INVALID_ARGUMENT, e.what());
  }
}

std::string deck_text(kmoe_layer_config const& c) {
  std::ostringstream os;
  auto quoted = [](char const* s, char const* def) { return std::string("\"") + (s ? s : def) + "\""; };
  os << "[run]\nseed = " << c.seed << "\n";
  os << "[model]\nhidden = " << c.hidden << "\nexperts = " << c.experts << "\ntop_k = " << c.top_k << "\nffn = " << c.ffn
     << "\nshared_experts = " << c.shared_experts << "\ndtype = " << (c.dtype == KMOE_BF16 ? "\"bf16\"" : "\"fp32\"") << "\n";
  if (c.payload) os << "payload = " << quoted(c.payload, "") << "\n";
  if (c.return_payload) os << "return_payload = " << quoted(c.return_payload, "") << "\n";
  os << "[tokens]\nper_rank = " << c.tokens_per_rank << "\n";
  os << "[router]\nscore = " << quoted(c.score, "softmax") << "\n";
  os << "[exchange]\nalgorithm = " << quoted(c.algorithm, "flat") << "\ntransport = " << quoted(c.transport, "mpi") << "\n";
  if (c.nodes > 0)
    os << "[topology]\nlayout = \"virtual\"\nnodes = " << c.nodes << "\n";
  else
    os << "[topology]\nlayout = \"hwloc\"\n";
  return os.str();
}

/// The integer a C caller stored in an enum-typed object. A C caller may
/// pass any int; in C++ reading such a value as the enum is undefined, so
/// arguments are read as their bits and compared as integers.
template <class E>
int raw(E const& e) {
  static_assert(sizeof(E) == sizeof(int), "C enums are int-sized");
  int v = 0;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

/// True where the caller's host arrays are the layer's memory (host builds).
constexpr bool host_space = Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible;

/// What is wrong with a memory kind argument of `call` ("" for nothing).
std::string memory_problem(char const* call, int memory) {
  std::ostringstream os;
  if (memory != KMOE_HOST && memory != KMOE_DEVICE)
    os << call << ": memory " << memory << " is neither KMOE_HOST nor KMOE_DEVICE";
  else if (memory == KMOE_DEVICE && host_space)
    os << call << ": device arrays need a CUDA build (this one runs on " << Exec::name() << ")";
  return os.str();
}

/// The caller's rows [n][d] as the layer's rows: in place where the layer can
/// read them (device arrays, host builds), else a copy into device rows
/// from the handle's staging workspace (no allocation in repeated calls).
template <class T>
RowMatrix<T, MS> caller_rows_in(Workspace<MS>& staging, void const* p, int64_t n, int64_t d, int memory, char const* label) {
  if (memory == KMOE_DEVICE || host_space) return RowMatrix<T, MS>(const_cast<T*>(static_cast<T const*>(p)), n, d);
  auto v = staging.template matrix<T>(Exec(), label, n, static_cast<std::size_t>(d));
  Kokkos::deep_copy(v, Kokkos::View<T const**, Kokkos::LayoutRight, Kokkos::HostSpace>(static_cast<T const*>(p), n, d));
  return v;
}

/// The caller's output rows [n][d]: in place, or device rows from the
/// staging workspace that caller_rows_out_done copies back.
template <class T>
RowMatrix<T, MS> caller_rows_out(Workspace<MS>& staging, void* p, int64_t n, int64_t d, int memory, char const* label) {
  if (memory == KMOE_DEVICE || host_space) return RowMatrix<T, MS>(static_cast<T*>(p), n, d);
  return staging.template matrix<T>(Exec(), label, n, static_cast<std::size_t>(d));
}

template <class T>
void caller_rows_out_done(RowMatrix<T, MS> const& v, void* p, int memory) {
  if (memory == KMOE_HOST && !host_space)
    Kokkos::deep_copy(Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::HostSpace>(static_cast<T*>(p), v.extent(0), v.extent(1)), v);
}

int dtype_size(kmoe_dtype t) { return t == KMOE_BF16 ? 2 : 4; }
char const* dtype_name(kmoe_dtype t) { return t == KMOE_BF16 ? "bf16" : "fp32"; }

}  // namespace

/// The layer behind the handle: its deck, run objects and the C++ layer of
/// the deck's dtype.
struct kmoe_layer {
  MPI_Comm comm = MPI_COMM_NULL;  ///< the caller's communicator, duplicated
  LayerDeck deck;
  Setup::Run run;
  std::unique_ptr<MoELayer<float, Exec, MS>> fp32;
  std::unique_ptr<MoELayer<bf16_t, Exec, MS>> bf16;
  StepRecord last;
  bool has_last = false;
  LayerGradients<MS> grads;  ///< of the last backward (fp32 layers; allocated with the layer, so their storage stays put)
  bool has_grads = false;
  Experts::ReplicaGradients replicas;  ///< sums a replicated expert's gradients over its copies
  Workspace<MS> replica_work{"kmoe::replicas"};
  Workspace<MS> staging{"kmoe::staging"};  ///< device rows of host arrays (device builds)

  kmoe_dtype dtype() const { return bf16 ? KMOE_BF16 : KMOE_FP32; }
  double watchdog() const { return deck.exchange.watchdog_seconds; }
  int rank() const { return comm_rank(comm); }

  template <class F>
  decltype(auto) visit(F&& f) {
    if (bf16) return f(*bf16);
    return f(*fp32);
  }
};

namespace {

/// Builds the layer of `deck` on `comm` (a duplicate of the caller's
/// communicator that the handle then owns; freed here on failure).
kmoe_status create(LayerDeck deck, MPI_Comm comm, kmoe_layer** out) {
  auto layer = std::make_unique<kmoe_layer>();
  layer->comm = comm;
  kmoe_status const st = guarded(KMOE_ERROR_INPUT, [&] {
    if (!Exchange::transport_available(deck.exchange.transport))
      fail(KMOE_ERROR_UNAVAILABLE, Exchange::transport_unavailable_reason(deck.exchange.transport));
    layer->deck = std::move(deck);
    auto const& d = layer->deck;
    layer->run = Setup::make_run(d, layer->comm);
    Exec exec;
    int const rank = layer->rank();
    if (d.model.dtype == "bf16") {
      layer->bf16 = std::make_unique<MoELayer<bf16_t, Exec, MS>>(
          layer->run.config, *layer->run.comms, layer->run.placement, Setup::router_weight<bf16_t, MS>(d),
          Setup::routed_weights<bf16_t, MS>(exec, d, layer->run, rank, layer->comm), Setup::shared_weights<bf16_t, MS>(exec, d));
      Setup::load_correction_bias(exec, d, layer->bf16->router());
    } else {
      layer->fp32 = std::make_unique<MoELayer<float, Exec, MS>>(
          layer->run.config, *layer->run.comms, layer->run.placement, Setup::router_weight<float, MS>(d),
          Setup::routed_weights<float, MS>(exec, d, layer->run, rank, layer->comm), Setup::shared_weights<float, MS>(exec, d));
      Setup::load_correction_bias(exec, d, layer->fp32->router());
      auto& l = *layer->fp32;
      layer->grads.routed = Experts::ExpertGradients<MS>(l.routed_weights());
      if (auto const* s = l.shared_weights(); s && s->num_slots() > 0) layer->grads.shared = Experts::ExpertGradients<MS>(*s);
      layer->grads.router = Kokkos::View<float**, Kokkos::LayoutRight, MS>("kmoe::router_grad", d.model.experts, d.model.hidden);
      layer->replicas = Experts::ReplicaGradients(layer->run.comms->ep().comm(), layer->run.placement, d.exchange.watchdog_seconds);
    }
  });
  if (st != KMOE_SUCCESS) {
    std::string const message = last_error;
    layer->replicas = Experts::ReplicaGradients();
    layer->fp32.reset();
    layer->bf16.reset();
    layer->run = Setup::Run();
    MPI_Comm_free(&layer->comm);
    last_error = message;
    return st;
  }
  *out = layer.release();
  return KMOE_SUCCESS;
}

/// The creation of a layer: arguments agreed and the deck read on a
/// duplicate of the caller's communicator (the handle's own: its messages
/// never meet the caller's), then the layer built on it.
template <class ReadDeck>
kmoe_status create_with(char const* call, MPI_Comm comm, kmoe_layer** layer, std::string const& problem, ReadDeck&& read) {
  if (!initialized) {
    last_error = std::string(call) + ": KokkosMoE is not initialized (call kmoe_initialize first)";
    return KMOE_ERROR_NOT_INITIALIZED;
  }
  MPI_Comm dup = MPI_COMM_NULL;
  if (MPI_Comm_dup(comm, &dup) != MPI_SUCCESS) {
    last_error = std::string(call) + ": MPI_Comm_dup of the given communicator failed";
    return KMOE_ERROR_INVALID_ARGUMENT;
  }
  LayerDeck deck;
  kmoe_status const st = guarded(KMOE_ERROR_INPUT, [&] {
    agree_arguments(dup, problem, call, 300.0);
    deck = read(dup);
  });
  if (st != KMOE_SUCCESS) {
    MPI_Comm_free(&dup);
    return st;
  }
  return create(std::move(deck), dup, layer);
}

kmoe_status create_from_deck(char const* deck_path, MPI_Comm comm, kmoe_layer** layer) {
  std::string problem;
  if (!deck_path) problem = "kmoe_layer_create_from_deck: deck_path is NULL";
  else if (!layer) problem = "kmoe_layer_create_from_deck: the layer pointer is NULL";
  return create_with("kmoe_layer_create_from_deck", comm, layer, problem,
                     [&](MPI_Comm c) { return read_layer_deck(c, deck_path); });
}

kmoe_status create_from_config(kmoe_layer_config const* config, MPI_Comm comm, kmoe_layer** layer) {
  std::string problem;
  if (!config) problem = "kmoe_layer_create: config is NULL";
  else if (!layer) problem = "kmoe_layer_create: the layer pointer is NULL";
  else if (raw(config->dtype) != KMOE_FP32 && raw(config->dtype) != KMOE_BF16)
    problem = "kmoe_layer_create: dtype " + std::to_string(raw(config->dtype)) + " is neither KMOE_FP32 nor KMOE_BF16";
  return create_with("kmoe_layer_create", comm, layer, problem,
                     [&](MPI_Comm c) { return parse_layer_deck("kmoe_layer_config", deck_text(*config), comm_size(c)); });
}

}  // namespace

extern "C" {

kmoe_layer_config kmoe_layer_config_default(void) {
  kmoe_layer_config c;
  c.hidden = 64;
  c.experts = 8;
  c.top_k = 2;
  c.ffn = 128;
  c.shared_experts = 0;
  c.dtype = KMOE_FP32;
  c.tokens_per_rank = 64;
  c.algorithm = nullptr;
  c.transport = nullptr;
  c.score = nullptr;
  c.payload = nullptr;
  c.return_payload = nullptr;
  c.nodes = 0;
  c.seed = 1234;
  return c;
}

kmoe_status kmoe_initialize(int* argc, char*** argv) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    if (initialized) return;
    int mpi = 0;
    MPI_Initialized(&mpi);
    if (!mpi) {
      int provided = 0;
      if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        fail(KMOE_ERROR_RUNTIME, "kmoe_initialize: MPI_Init_thread failed");
      started_mpi = true;
    }
    if (!Kokkos::is_initialized()) {
      int dummy_argc = 0;
      char** dummy_argv = nullptr;
      Kokkos::initialize(argc ? *argc : dummy_argc, argv ? *argv : dummy_argv);
      started_kokkos = true;
    }
    initialized = true;
  });
}

kmoe_status kmoe_finalize(void) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_finalize");
    if (started_kokkos) Kokkos::finalize();
    if (started_mpi) MPI_Finalize();
    started_kokkos = started_mpi = false;
    initialized = false;
  });
}

int kmoe_is_initialized(void) { return initialized ? 1 : 0; }

const char* kmoe_last_error(void) { return last_error.c_str(); }

const char* kmoe_version(void) { return KOKKOSMOE_VERSION_STRING; }

const char* kmoe_build_configuration(void) {
  static std::string const text = [] {
    json j;
    j["version"] = KOKKOSMOE_VERSION_STRING;
    j["git_hash"] = KokkosMoE::git_hash();
    j["kokkos_flavor"] = KOKKOSMOE_KOKKOS_FLAVOR;
    j["kokkos_execution_space"] = Exec::name();
    j["kokkos_kernels"] = have_kokkos_kernels();
    j["hdf5"] = KOKKOSMOE_HAVE_HDF5_CMAKE == 1;
    j["nccl"] = KOKKOSMOE_HAVE_NCCL_CMAKE == 1;
    j["cublas"] = KOKKOSMOE_HAVE_CUBLAS_CMAKE == 1;
    j["summary"] = build_summary();
    return j.dump();
  }();
  return text.c_str();
}

kmoe_status kmoe_layer_create_from_deck(const char* deck_path, MPI_Comm comm, kmoe_layer** layer) {
  return create_from_deck(deck_path, comm, layer);
}

kmoe_status kmoe_layer_create_from_deck_f(const char* deck_path, MPI_Fint comm, kmoe_layer** layer) {
  return create_from_deck(deck_path, MPI_Comm_f2c(comm), layer);
}

kmoe_status kmoe_layer_create(const kmoe_layer_config* config, MPI_Comm comm, kmoe_layer** layer) {
  return create_from_config(config, comm, layer);
}

kmoe_status kmoe_layer_create_f(const kmoe_layer_config* config, MPI_Fint comm, kmoe_layer** layer) {
  return create_from_config(config, MPI_Comm_f2c(comm), layer);
}

kmoe_status kmoe_layer_destroy(kmoe_layer* layer) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_destroy");
    if (!layer) return;
    std::unique_ptr<kmoe_layer> owned(layer);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      (void)owned.release();  // its communicators cannot be freed any more
      fail(KMOE_ERROR_RUNTIME, "kmoe_layer_destroy: MPI is already finalized; destroy layers before MPI_Finalize");
    }
    MPI_Comm comm = owned->comm;
    owned.reset();  // the layer's communicators are freed collectively
    MPI_Comm_free(&comm);
  });
}

kmoe_status kmoe_layer_check(kmoe_layer* layer, int ok, const char* message) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_check");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_check: layer is NULL");
    std::string problem;
    if (!ok) problem = std::string(message && *message ? message : "arguments refused") + " (rank " + std::to_string(layer->rank()) + ")";
    agree_arguments(layer->comm, problem, "arguments of a collective call", layer->watchdog());
  });
}

kmoe_status kmoe_report_error(kmoe_status status, const char* message) {
  last_error = message ? message : "";
  return status;
}

kmoe_status kmoe_layer_shape(const kmoe_layer* layer, int64_t* hidden, int32_t* experts, int32_t* top_k, kmoe_dtype* dtype,
                             int64_t* tokens_per_rank) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_shape");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_shape: layer is NULL");
    if (hidden) *hidden = layer->deck.model.hidden;
    if (experts) *experts = layer->deck.model.experts;
    if (top_k) *top_k = layer->deck.model.top_k;
    if (dtype) *dtype = layer->dtype();
    if (tokens_per_rank) *tokens_per_rank = Setup::tokens_per_rank(layer->deck);
  });
}

kmoe_status kmoe_layer_forward(kmoe_layer* layer, const void* hidden, int64_t tokens, int64_t hidden_dim, kmoe_dtype dtype_arg,
                               kmoe_memory memory_arg, void* out) {
  int const dtype = raw(dtype_arg), memory = raw(memory_arg);
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_forward");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_forward: layer is NULL");
    std::ostringstream problem;
    int64_t const d = layer->deck.model.hidden;
    if (tokens < 0) problem << "kmoe_layer_forward: tokens = " << tokens << " is negative";
    else if (tokens > 0 && (!hidden || !out)) problem << "kmoe_layer_forward: " << (!hidden ? "hidden" : "out") << " is NULL";
    else if (hidden_dim != d) problem << "kmoe_layer_forward: rows of " << hidden_dim << " elements, the layer's hidden width is " << d;
    else if (dtype != static_cast<int>(layer->dtype()))
      problem << "kmoe_layer_forward: " << (dtype == KMOE_BF16 ? "bf16" : dtype == KMOE_FP32 ? "fp32" : "unknown") << " rows, the layer computes in "
              << dtype_name(layer->dtype());
    else problem << memory_problem("kmoe_layer_forward", memory);
    if (!problem.str().empty()) problem << " (rank " << layer->rank() << ")";
    agree_arguments(layer->comm, problem.str(), "kmoe_layer_forward arguments", layer->watchdog());
    layer->visit([&](auto& l) {
      using T = typename std::remove_reference_t<decltype(l)>::value_type;
      Exec exec;
      auto in = caller_rows_in<T>(layer->staging, hidden, tokens, d, memory, "hidden");
      auto res = caller_rows_out<T>(layer->staging, out, tokens, d, memory, "out");
      layer->last = l.forward(exec, in, res);
      layer->has_last = true;
      caller_rows_out_done(res, out, memory);
      Compat::fence(exec, "kmoe_layer_forward");
    });
  });
}

kmoe_status kmoe_layer_backward(kmoe_layer* layer, const void* hidden, const void* dout, int64_t tokens, int64_t hidden_dim,
                                kmoe_dtype dtype_arg, kmoe_memory memory_arg, void* dx) {
  int const dtype = raw(dtype_arg), memory = raw(memory_arg);
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_backward");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_backward: layer is NULL");
    std::ostringstream problem;
    int64_t const d = layer->deck.model.hidden;
    if (!layer->fp32) problem << "kmoe_layer_backward: the layer computes in bf16; the backward needs an fp32 layer";
    else if (!layer->has_last) problem << "kmoe_layer_backward: the layer has not run a forward yet";
    else if (tokens < 0) problem << "kmoe_layer_backward: tokens = " << tokens << " is negative";
    else if (tokens > 0 && (!hidden || !dout || !dx)) problem << "kmoe_layer_backward: " << (!hidden ? "hidden" : !dout ? "dout" : "dx") << " is NULL";
    else if (hidden_dim != d) problem << "kmoe_layer_backward: rows of " << hidden_dim << " elements, the layer's hidden width is " << d;
    else if (dtype != KMOE_FP32) problem << "kmoe_layer_backward: rows must be fp32";
    else problem << memory_problem("kmoe_layer_backward", memory);
    if (!problem.str().empty()) problem << " (rank " << layer->rank() << ")";
    agree_arguments(layer->comm, problem.str(), "kmoe_layer_backward arguments", layer->watchdog());
    Exec exec;
    auto h = caller_rows_in<float>(layer->staging, hidden, tokens, d, memory, "hidden");
    auto g = caller_rows_in<float>(layer->staging, dout, tokens, d, memory, "dout");
    auto x = caller_rows_out<float>(layer->staging, dx, tokens, d, memory, "dx");
    LayerBackwardOptions options;
    options.gradient_block = layer->deck.train.gradient_block;
    options.reproducible_shared = layer->deck.train.reproducible_shared;
    layer->fp32->backward(exec, h, g, x, layer->grads, options);
    layer->replicas.reduce(exec, layer->grads.routed, layer->run.placement.generation(), &layer->replica_work);
    layer->has_grads = true;
    caller_rows_out_done(x, dx, memory);
    Compat::fence(exec, "kmoe_layer_backward");
  });
}

kmoe_status kmoe_layer_gradient_norm(kmoe_layer* layer, double* norm) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_gradient_norm");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_gradient_norm: layer is NULL");
    std::string problem;
    if (!norm) problem = "kmoe_layer_gradient_norm: norm is NULL";
    else if (!layer->has_grads) problem = "kmoe_layer_gradient_norm: the layer has not run a backward yet";
    agree_arguments(layer->comm, problem, "kmoe_layer_gradient_norm arguments", layer->watchdog());
    auto sq = [](auto const& v) {
      auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
      double s = 0.0;
      for (std::size_t i = 0; i < h.size(); ++i) s += static_cast<double>(h.data()[i]) * h.data()[i];
      return s;
    };
    auto const& g = layer->grads;
    // Routed slots on every rank, each expert once (every copy holds its
    // total); router and shared experts (the same on every rank) once.
    auto const& p = layer->run.placement;
    auto const& mine = p.slots_of_rank(layer->run.comms->global_rank());
    auto sq_slot = [&](auto const& v, std::size_t q) { return sq(Kokkos::subview(v, q, Kokkos::ALL, Kokkos::ALL)); };
    double local = 0.0;
    for (std::size_t q = 0; q < mine.size(); ++q)
      local += (sq_slot(g.routed.gate, q) + sq_slot(g.routed.up, q) + sq_slot(g.routed.down, q)) /
               p.logcnt()[static_cast<std::size_t>(p.slot(mine[q]).expert)];
    if (layer->rank() == 0) {
      local += sq(g.router);
      if (g.shared.num_slots() > 0) local += sq(g.shared.gate) + sq(g.shared.up) + sq(g.shared.down);
    }
    double total = 0.0;
    allreduce_watched(&local, &total, 1, MPI_DOUBLE, MPI_SUM, layer->comm, "kmoe_layer_gradient_norm", layer->watchdog());
    *norm = std::sqrt(total);
  });
}

kmoe_status kmoe_layer_deck_rows(const kmoe_layer* layer, int32_t step, void* hidden, int64_t tokens, int64_t hidden_dim) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_deck_rows");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_deck_rows: layer is NULL");
    auto const& d = layer->deck;
    int64_t const T = Setup::tokens_per_rank(d);
    if (!hidden) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_deck_rows: hidden is NULL");
    if (step < 0) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_deck_rows: step " + std::to_string(step) + " is negative");
    if (tokens != T || hidden_dim != d.model.hidden)
      fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_deck_rows: a " + std::to_string(tokens) + " x " + std::to_string(hidden_dim) +
                                            " array, the deck gives " + std::to_string(T) + " x " + std::to_string(d.model.hidden));
    if (d.tokens.source != "router")
      fail(KMOE_ERROR_INPUT, "kmoe_layer_deck_rows: the deck's tokens come with their routes ([tokens] source = \"" + d.tokens.source +
                                 "\"); only router-sourced decks give rows for a forward");
    int const rank = layer->rank();
    auto fill = [&](auto tag) {
      using T_ = decltype(tag);
      auto rows = Setup::hidden_rows<T_, Kokkos::HostSpace>(d, step, Setup::first_token(d, rank), T, rank);
      std::memcpy(hidden, rows.data(), rows.span() * sizeof(T_));
    };
    if (layer->dtype() == KMOE_BF16)
      fill(bf16_t{});
    else
      fill(float{});
  });
}

kmoe_status kmoe_layer_digest(kmoe_layer* layer, const void* out, int64_t tokens, int64_t hidden_dim, char digest[17]) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_digest");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_digest: layer is NULL");
    std::string problem;
    if (!digest) problem = "kmoe_layer_digest: digest is NULL";
    else if (tokens < 0 || hidden_dim != layer->deck.model.hidden) problem = "kmoe_layer_digest: a " + std::to_string(tokens) + " x " + std::to_string(hidden_dim) + " array for hidden width " + std::to_string(layer->deck.model.hidden);
    else if (tokens > 0 && !out) problem = "kmoe_layer_digest: out is NULL";
    std::size_t const bytes = problem.empty() ? static_cast<std::size_t>(tokens) * static_cast<std::size_t>(hidden_dim) * dtype_size(layer->dtype()) : 0;
    void const* rows = out;
    std::vector<unsigned char> staged;  // device rows, read on the host
    if (bytes > 0 && is_device_pointer(out)) {
      staged.resize(bytes);
      std::string const failed = copy_device_to_host(staged.data(), out, bytes);
      if (!failed.empty()) problem = "kmoe_layer_digest: copying the device rows failed: " + failed;
      rows = staged.data();
    }
    agree_arguments(layer->comm, problem, "kmoe_layer_digest arguments", layer->watchdog());
    std::string const d = ranks_digest(layer->comm, rows, bytes, layer->watchdog());
    std::memcpy(digest, d.c_str(), 17);
  });
}

kmoe_status kmoe_layer_save_weights(kmoe_layer* layer, const char* path) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_save_weights");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_save_weights: layer is NULL");
    agree_arguments(layer->comm, path ? "" : "kmoe_layer_save_weights: path is NULL", "kmoe_layer_save_weights arguments", layer->watchdog());
    layer->visit([&](auto& l) { l.routed_weights().save(layer->comm, path, layer->deck.model.experts); });
  });
}

kmoe_status kmoe_layer_load_weights(kmoe_layer* layer, const char* path) {
  return guarded(KMOE_ERROR_INPUT, [&] {
    require_initialized("kmoe_layer_load_weights");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_load_weights: layer is NULL");
    agree_arguments(layer->comm, path ? "" : "kmoe_layer_load_weights: path is NULL", "kmoe_layer_load_weights arguments", layer->watchdog());
    layer->visit([&](auto& l) {
      l.routed_weights().load(layer->comm, path,
                              Experts::LoadContext{layer->run.comms->epoch(), layer->run.placement.generation()});
    });
  });
}

kmoe_status kmoe_layer_last_step(const kmoe_layer* layer, kmoe_step_summary* summary) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_last_step");
    if (!layer || !summary) fail(KMOE_ERROR_INVALID_ARGUMENT, std::string("kmoe_layer_last_step: ") + (!layer ? "layer" : "summary") + " is NULL");
    if (!layer->has_last) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_last_step: the layer has not run a forward yet");
    auto const& r = layer->last;
    auto const& disp = r.ledger.dispatch;
    auto sec = [&](char const* k) {
      auto it = r.seconds.find(k);
      return it == r.seconds.end() ? 0.0 : it->second;
    };
    *summary = kmoe_step_summary{};
    summary->tokens = r.tokens;
    summary->routes_attempted = r.routes.attempted;
    summary->routes_accepted = r.routes.accepted;
    summary->routes_dropped = r.routes.dropped;
    summary->dispatch_rows = disp.useful_rows;
    summary->same_rank_bytes = disp.by_class(Exchange::LinkClass::same_rank).payload_bytes;
    summary->intra_node_bytes = disp.by_class(Exchange::LinkClass::intra_node).payload_bytes;
    summary->inter_node_bytes = disp.inter_node_payload_bytes();
    summary->relay_rows = disp.relay_rows();
    summary->seconds_total = sec("total");
    summary->seconds_router = sec("router");
    summary->seconds_dispatch = sec("dispatch");
    summary->seconds_experts = sec("experts");
    summary->seconds_combine_exchange = sec("combine_exchange");
    summary->seconds_combine = sec("combine");
    summary->seconds_shared_experts = sec("shared_experts");
  });
}

namespace {
kmoe_status copy_out(std::string const& text, char* buffer, size_t size, size_t* needed, char const* call) {
  if (needed) *needed = text.size() + 1;
  if (!buffer) return KMOE_SUCCESS;  // a size query
  if (size < text.size() + 1)
    fail(KMOE_ERROR_BUFFER_TOO_SMALL, std::string(call) + ": the buffer holds " + std::to_string(size) + " bytes, the text needs " +
                                          std::to_string(text.size() + 1));
  std::memcpy(buffer, text.c_str(), text.size() + 1);
  return KMOE_SUCCESS;
}
}  // namespace

kmoe_status kmoe_layer_last_step_json(const kmoe_layer* layer, char* buffer, size_t size, size_t* needed) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_last_step_json");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_last_step_json: layer is NULL");
    if (!layer->has_last) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_last_step_json: the layer has not run a forward yet");
    auto const& r = layer->last;
    json j;
    j["algorithm"] = r.algorithm;
    j["transport"] = r.transport;
    j["schedule"] = r.schedule;
    j["tokens"] = r.tokens;
    j["routes"] = {{"attempted", r.routes.attempted}, {"accepted", r.routes.accepted}, {"dropped", r.routes.dropped}};
    j["seconds"] = r.seconds;
    j["ledger"] = json::parse(r.ledger.to_json(0));
    j["experts_path"] = r.experts.path;
    json tasks = json::array();
    for (auto const& t : r.tasks) tasks.push_back({{"name", t.name}, {"stream", t.stream}, {"start", t.start}, {"end", t.end}});
    j["tasks"] = tasks;
    copy_out(j.dump(), buffer, size, needed, "kmoe_layer_last_step_json");
  });
}

kmoe_status kmoe_layer_topology_json(const kmoe_layer* layer, char* buffer, size_t size, size_t* needed) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_topology_json");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_topology_json: layer is NULL");
    copy_out(layer->run.comms->to_json(0), buffer, size, needed, "kmoe_layer_topology_json");
  });
}

kmoe_status kmoe_layer_placement(const kmoe_layer* layer, int32_t* slot_expert, int32_t* slot_rank, int32_t capacity,
                                 int32_t* num_slots) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_placement");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_placement: layer is NULL");
    auto const& p = layer->run.placement;
    int const S = p.num_slots();
    if (num_slots) *num_slots = S;
    if (!slot_expert && !slot_rank) return;  // a size query
    if (capacity < S)
      fail(KMOE_ERROR_BUFFER_TOO_SMALL, "kmoe_layer_placement: arrays of " + std::to_string(capacity) + " entries for " + std::to_string(S) + " slots");
    for (int s = 0; s < S; ++s) {
      if (slot_expert) slot_expert[s] = p.slot(s).expert;
      if (slot_rank) slot_rank[s] = p.slot(s).rank;
    }
  });
}

kmoe_status kmoe_eplb(const double* loads, int32_t num_experts, int32_t num_slots, int32_t num_ranks, int32_t num_nodes, int32_t groups,
                      int32_t* slot_expert, int32_t* slot_rank) {
  return guarded(KMOE_ERROR_INPUT, [&] {
    require_initialized("kmoe_eplb");
    if (!loads || !slot_expert || !slot_rank)
      fail(KMOE_ERROR_INVALID_ARGUMENT, std::string("kmoe_eplb: ") + (!loads ? "loads" : !slot_expert ? "slot_expert" : "slot_rank") + " is NULL");
    if (num_experts < 1 || num_slots < 1 || num_ranks < 1 || num_nodes < 1 || groups < 1)
      fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_eplb: experts " + std::to_string(num_experts) + ", slots " + std::to_string(num_slots) +
                                            ", ranks " + std::to_string(num_ranks) + ", nodes " + std::to_string(num_nodes) + ", groups " +
                                            std::to_string(groups) + " must all be >= 1");
    PlacementSpec spec;
    spec.physical_slots = num_slots;
    spec.ranks = num_ranks;
    spec.nodes = num_nodes;
    spec.groups = groups;
    LayerPlacement const lp = eplb_layer(std::vector<double>(loads, loads + num_experts), spec);
    for (int s = 0; s < lp.placement.num_slots(); ++s) {
      slot_expert[s] = lp.placement.slot(s).expert;
      slot_rank[s] = lp.placement.slot(s).rank;
    }
  });
}

}  // extern "C"

namespace {

/// The element count a caller's array must have for one tensor of p.
template <class L>
std::string count_problem(L const& l, Parameter p, int64_t count, float const* values, char const* call, bool may_be_empty) {
  std::size_t const n = parameter_elements(l, p);
  if (may_be_empty && values == nullptr && count == 0) return {};
  if (values == nullptr) return std::string(call) + ": values is NULL";
  if (count < 0 || static_cast<std::size_t>(count) != n)
    return std::string(call) + ": " + parameter_name(p) + " tensors have " + std::to_string(n) + " elements, count is " + std::to_string(count);
  return {};
}

/// What is wrong with a C caller's parameter ("" for nothing).
std::string parameter_problem(int raw_parameter, char const* call) {
  if (raw_parameter < 0 || raw_parameter >= static_cast<int>(all_parameters().size()))
    return std::string(call) + ": parameter " + std::to_string(raw_parameter) + " is not a kmoe_parameter";
  return {};
}

/// The parameter a C caller named, checked.
Parameter parameter_of(int raw_parameter, char const* call) {
  std::string const problem = parameter_problem(raw_parameter, call);
  if (!problem.empty()) fail(KMOE_ERROR_INVALID_ARGUMENT, problem);
  return all_parameters()[static_cast<std::size_t>(raw_parameter)];
}

/// The argument problem of a collective parameter call: the parameter, the
/// index, and (values given) the element count.
template <class L>
std::string parameter_call_problem(L const& l, int raw_parameter, int32_t index, int64_t count, float const* values, char const* call,
                                   bool may_be_empty) {
  std::string problem = parameter_problem(raw_parameter, call);
  if (problem.empty()) problem = Impl::parameter_index_problem(l, parameter_of(raw_parameter, call), index, call);
  if (problem.empty()) problem = count_problem(l, parameter_of(raw_parameter, call), count, values, call, may_be_empty);
  return problem;
}

/// The layer's storage of p on this rank: data, extents.
template <class L>
std::pair<void*, std::vector<int64_t>> storage_of(L& l, Parameter p) {
  using Tw = typename L::value_type;
  auto view3 = [](auto const& v) -> std::pair<void*, std::vector<int64_t>> {
    return {static_cast<void*>(v.data()), {static_cast<int64_t>(v.extent(0)), static_cast<int64_t>(v.extent(1)), static_cast<int64_t>(v.extent(2))}};
  };
  if (p == Parameter::router_weight) {
    auto const& w = l.router_weight();
    return {static_cast<void*>(const_cast<Tw*>(w.data())), {static_cast<int64_t>(w.extent(0)), static_cast<int64_t>(w.extent(1))}};
  }
  if (p == Parameter::correction_bias) {
    auto const& b = l.router().correction_bias();
    return {static_cast<void*>(b.data()), {static_cast<int64_t>(b.extent(0))}};
  }
  if (p == Parameter::shared_gate || p == Parameter::shared_up || p == Parameter::shared_down) {
    auto* s = l.shared_weights();
    if (!s || s->num_slots() == 0) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_parameter_storage: the layer has no shared experts");
    return view3(Impl::family_tensor(*s, p));
  }
  return view3(Impl::family_tensor(l.routed_weights(), p));
}

void write_shape(std::vector<int64_t> const& dims, int32_t* ndim, int64_t* shape) {
  if (ndim) *ndim = static_cast<int32_t>(dims.size());
  if (shape)
    for (std::size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
}

}  // namespace

extern "C" {

const char* kmoe_parameter_name(kmoe_parameter parameter) {
  int const p = raw(parameter);
  if (p < 0 || p >= static_cast<int>(all_parameters().size())) return "";
  return parameter_name(all_parameters()[static_cast<std::size_t>(p)]);
}

kmoe_status kmoe_layer_parameter_info(const kmoe_layer* layer, kmoe_parameter parameter, int32_t* count, int32_t* ndim, int64_t shape[2]) {
  int const rp = raw(parameter);
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_parameter_info");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_parameter_info: layer is NULL");
    Parameter const p = parameter_of(rp, "kmoe_layer_parameter_info");
    const_cast<kmoe_layer*>(layer)->visit([&](auto& l) {
      if (count) *count = parameter_count(l, p);
      write_shape(parameter_shape(l, p), ndim, shape);
    });
  });
}

kmoe_status kmoe_layer_get_parameter(kmoe_layer* layer, kmoe_parameter parameter, int32_t index, float* values, int64_t count) {
  int const rp = raw(parameter);
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_get_parameter");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_get_parameter: layer is NULL");
    std::string problem;
    layer->visit([&](auto& l) { problem = parameter_call_problem(l, rp, index, count, values, "kmoe_layer_get_parameter", false); });
    if (!problem.empty()) problem += " (rank " + std::to_string(layer->rank()) + ")";
    agree_arguments(layer->comm, problem, "kmoe_layer_get_parameter arguments", layer->watchdog());
    layer->visit([&](auto& l) {
      auto const v = get_parameter(Exec(), l, parameter_of(rp, ""), index);
      std::memcpy(values, v.data(), v.size() * sizeof(float));
    });
  });
}

kmoe_status kmoe_layer_set_parameter(kmoe_layer* layer, kmoe_parameter parameter, int32_t index, const float* values, int64_t count) {
  int const rp = raw(parameter);
  return guarded(KMOE_ERROR_INPUT, [&] {
    require_initialized("kmoe_layer_set_parameter");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_set_parameter: layer is NULL");
    std::string problem = parameter_problem(rp, "kmoe_layer_set_parameter");
    if (problem.empty())
      layer->visit([&](auto& l) { problem = Impl::parameter_index_problem(l, parameter_of(rp, ""), index, "kmoe_layer_set_parameter"); });
    if (problem.empty() && count < 0) problem = "kmoe_layer_set_parameter: count " + std::to_string(count) + " is negative";
    if (!problem.empty()) problem += " (rank " + std::to_string(layer->rank()) + ")";
    agree_arguments(layer->comm, problem, "kmoe_layer_set_parameter arguments", layer->watchdog());
    try {
      layer->visit([&](auto& l) { set_parameter(Exec(), l, parameter_of(rp, ""), index, values, static_cast<std::size_t>(count)); });
    } catch (std::exception const& e) {
      fail(KMOE_ERROR_INVALID_ARGUMENT, e.what());
    }
  });
}

kmoe_status kmoe_layer_get_gradient(kmoe_layer* layer, kmoe_parameter parameter, int32_t index, float* values, int64_t count) {
  int const rp = raw(parameter);
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_get_gradient");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_get_gradient: layer is NULL");
    std::string problem = parameter_problem(rp, "kmoe_layer_get_gradient");
    if (problem.empty() && !layer->fp32) problem = "kmoe_layer_get_gradient: the layer computes in bf16 and has no backward";
    else if (problem.empty() && !layer->has_grads) problem = "kmoe_layer_get_gradient: the layer has not run a backward yet";
    if (problem.empty()) problem = parameter_call_problem(*layer->fp32, rp, index, count, values, "kmoe_layer_get_gradient", false);
    if (problem.empty() && rp == KMOE_CORRECTION_BIAS)
      problem = "kmoe_layer_get_gradient: the correction bias has no gradient (it only selects experts)";
    if (!problem.empty()) problem += " (rank " + std::to_string(layer->rank()) + ")";
    agree_arguments(layer->comm, problem, "kmoe_layer_get_gradient arguments", layer->watchdog());
    try {
      auto const v = get_gradient(Exec(), *layer->fp32, layer->grads, parameter_of(rp, ""), index, ReplicaSums::reduced);
      std::memcpy(values, v.data(), v.size() * sizeof(float));
    } catch (CollectiveError const& e) {
      fail(KMOE_ERROR_INVALID_ARGUMENT, e.what());
    }
  });
}

kmoe_status kmoe_layer_parameter_storage(kmoe_layer* layer, kmoe_parameter parameter, void** data, int32_t* ndim, int64_t shape[3],
                                         kmoe_dtype* dtype, kmoe_memory* memory) {
  int const rp = raw(parameter);
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_parameter_storage");
    if (!layer || !data) fail(KMOE_ERROR_INVALID_ARGUMENT, std::string("kmoe_layer_parameter_storage: ") + (!layer ? "layer" : "data") + " is NULL");
    Parameter const p = parameter_of(rp, "kmoe_layer_parameter_storage");
    if (p == Parameter::correction_bias && !layer->run.config.router.use_correction_bias)
      fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_parameter_storage: the layer's router has no correction bias (router.correction_bias = false)");
    layer->visit([&](auto& l) {
      auto const s = storage_of(l, p);
      *data = s.first;
      write_shape(s.second, ndim, shape);
    });
    if (dtype) *dtype = p == Parameter::correction_bias ? KMOE_FP32 : layer->dtype();
    if (memory) *memory = host_space ? KMOE_HOST : KMOE_DEVICE;
  });
}

kmoe_status kmoe_layer_gradient_storage(kmoe_layer* layer, kmoe_parameter parameter, float** data, int32_t* ndim, int64_t shape[3],
                                        kmoe_memory* memory) {
  int const rp = raw(parameter);
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_gradient_storage");
    if (!layer || !data) fail(KMOE_ERROR_INVALID_ARGUMENT, std::string("kmoe_layer_gradient_storage: ") + (!layer ? "layer" : "data") + " is NULL");
    Parameter const p = parameter_of(rp, "kmoe_layer_gradient_storage");
    if (!layer->fp32) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_gradient_storage: the layer computes in bf16 and has no backward");
    if (p == Parameter::correction_bias)
      fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_gradient_storage: the correction bias has no gradient (it only selects experts)");
    auto const& g = layer->grads;
    auto view3 = [&](auto const& v) {
      *data = v.data();
      write_shape({static_cast<int64_t>(v.extent(0)), static_cast<int64_t>(v.extent(1)), static_cast<int64_t>(v.extent(2))}, ndim, shape);
    };
    if (p == Parameter::router_weight) {
      *data = g.router.data();
      write_shape({static_cast<int64_t>(g.router.extent(0)), static_cast<int64_t>(g.router.extent(1))}, ndim, shape);
    } else if (p == Parameter::shared_gate || p == Parameter::shared_up || p == Parameter::shared_down) {
      if (g.shared.num_slots() == 0) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_gradient_storage: the layer has no shared experts");
      view3(Impl::gradient_tensor(g.shared, p));
    } else {
      view3(Impl::gradient_tensor(g.routed, p));
    }
    if (memory) *memory = host_space ? KMOE_HOST : KMOE_DEVICE;
  });
}

kmoe_status kmoe_layer_local_experts(const kmoe_layer* layer, int32_t* experts, int32_t capacity, int32_t* count) {
  return guarded(KMOE_ERROR_RUNTIME, [&] {
    require_initialized("kmoe_layer_local_experts");
    if (!layer) fail(KMOE_ERROR_INVALID_ARGUMENT, "kmoe_layer_local_experts: layer is NULL");
    auto const& p = layer->run.placement;
    auto const& mine = p.slots_of_rank(layer->run.comms->global_rank());
    int const n = static_cast<int>(mine.size());
    if (count) *count = n;
    if (!experts) return;
    if (capacity < n)
      fail(KMOE_ERROR_BUFFER_TOO_SMALL, "kmoe_layer_local_experts: an array of " + std::to_string(capacity) + " entries for " + std::to_string(n) + " slots");
    for (int q = 0; q < n; ++q) experts[q] = p.slot(mine[static_cast<std::size_t>(q)]).expert;
  });
}

}  // extern "C"
