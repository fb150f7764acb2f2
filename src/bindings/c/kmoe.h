#ifndef KMOE_H
#define KMOE_H

/* kmoe.h: the C interface of KokkosMoE.
 *
 * Opaque handles, plain types, no C++ across the boundary. Every call
 * returns a kmoe_status; on failure kmoe_last_error() gives the message.
 * Calls marked "collective" must be made by every rank of the layer's
 * communicator in the same order; their arguments are checked on every rank
 * and a problem found on one rank is reported by all of them, with the same
 * message, so no rank is left waiting. No call throws and no call aborts
 * the process on bad input.
 *
 *   kmoe_initialize(&argc, &argv);                       MPI and Kokkos (unless the caller started them)
 *   kmoe_layer* layer;
 *   kmoe_layer_create_from_deck("inputs/quickstart.toml", MPI_COMM_WORLD, &layer);
 *   kmoe_layer_forward(layer, hidden, tokens, d, KMOE_FP32, KMOE_HOST, out);
 *   kmoe_layer_destroy(layer);
 *   kmoe_finalize();
 *
 * Rows are row-major [tokens][hidden] arrays of fp32, or of bf16 stored as
 * uint16_t (the upper half of the float's bits). A Fortran array
 * hidden(d, tokens) is the same memory.
 */

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Outcome of a call. */
typedef enum kmoe_status {
  KMOE_SUCCESS = 0,
  KMOE_ERROR_INVALID_ARGUMENT = 1, /**< a null pointer, a wrong shape, dtype or value */
  KMOE_ERROR_NOT_INITIALIZED = 2,  /**< a call before kmoe_initialize or after kmoe_finalize */
  KMOE_ERROR_INPUT = 3,            /**< a deck, weights file or value the library refuses */
  KMOE_ERROR_RUNTIME = 4,          /**< a failure while running (a missing rank, a failed transfer) */
  KMOE_ERROR_UNAVAILABLE = 5,      /**< a feature this build does not have */
  KMOE_ERROR_BUFFER_TOO_SMALL = 6  /**< an output buffer is smaller than the result (see `needed`) */
} kmoe_status;

/** Element type of rows. */
typedef enum kmoe_dtype { KMOE_FP32 = 0, KMOE_BF16 = 1 } kmoe_dtype;

/** Where a caller's array lives. KMOE_DEVICE: device memory of a CUDA build. */
typedef enum kmoe_memory { KMOE_HOST = 0, KMOE_DEVICE = 1 } kmoe_memory;

/** A layer: its communicators, placement, router, experts and exchange. */
typedef struct kmoe_layer kmoe_layer;

/** A layer described without a deck (the deck keys of the same names). */
typedef struct kmoe_layer_config {
  int64_t hidden;          /**< [model] hidden */
  int32_t experts;         /**< [model] experts */
  int32_t top_k;           /**< [model] top_k */
  int64_t ffn;             /**< [model] ffn */
  int32_t shared_experts;  /**< [model] shared_experts */
  kmoe_dtype dtype;        /**< [model] dtype */
  int64_t tokens_per_rank; /**< [tokens] per_rank: the largest forward (pooled-wave shapes) */
  const char* algorithm;   /**< [exchange] algorithm: "flat", "hierarchical", "pooled_wave"; NULL: "flat" */
  const char* transport;   /**< [exchange] transport: "mpi", "nccl"; NULL: "mpi" */
  const char* score;       /**< [router] score: "softmax", "sigmoid"; NULL: "softmax" */
  const char* payload;     /**< [model] payload: rows on the dispatch wire ("fp32", "bf16", ...); NULL: the deck default */
  const char* return_payload; /**< [model] return_payload: rows on the combine wire; NULL: the deck default */
  int32_t nodes;           /**< [topology] nodes of a virtual layout; 0: the machine's (hwloc) */
  uint64_t seed;           /**< [run] seed of the router and expert weights */
} kmoe_layer_config;

/** Defaults of kmoe_layer_config (the deck's defaults). */
kmoe_layer_config kmoe_layer_config_default(void);

/** What the last forward of a layer did on this rank. */
typedef struct kmoe_step_summary {
  int64_t tokens;
  int64_t routes_attempted, routes_accepted, routes_dropped;
  int64_t dispatch_rows;    /**< rows this rank's dispatch delivered */
  int64_t same_rank_bytes, intra_node_bytes, inter_node_bytes; /**< dispatch payload bytes by link class */
  int64_t relay_rows;       /**< rows moved through relays (hierarchical) */
  double seconds_total, seconds_router, seconds_dispatch, seconds_experts, seconds_combine_exchange, seconds_combine,
      seconds_shared_experts;
} kmoe_step_summary;

/* ---- the library --------------------------------------------------------- */

/** Initializes MPI (MPI_THREAD_FUNNELED) unless it is initialized, and
 *  Kokkos unless it is initialized (argc/argv may be NULL; --kokkos-*
 *  arguments are read). kmoe_finalize finalizes only what this started. */
kmoe_status kmoe_initialize(int* argc, char*** argv);
/** Finalizes what kmoe_initialize started. Layers must be destroyed first. */
kmoe_status kmoe_finalize(void);
/** 1 between kmoe_initialize and kmoe_finalize, else 0. */
int kmoe_is_initialized(void);
/** The message of the last failed call on this thread ("" after success). */
const char* kmoe_last_error(void);
/** "0.1.0". */
const char* kmoe_version(void);
/** The build as JSON: version, git hash, Kokkos flavor and devices, Kokkos
 *  Kernels, HDF5, NCCL, cuBLAS. */
const char* kmoe_build_configuration(void);

/* ---- layers -------------------------------------------------------------- */

/** Collective over comm: a layer from a TOML deck (inputs/README.md). */
kmoe_status kmoe_layer_create_from_deck(const char* deck_path, MPI_Comm comm, kmoe_layer** layer);
/** The same with a Fortran communicator handle. */
kmoe_status kmoe_layer_create_from_deck_f(const char* deck_path, MPI_Fint comm, kmoe_layer** layer);
/** Collective over comm: a layer from a configuration (every other deck key
 *  at its default). */
kmoe_status kmoe_layer_create(const kmoe_layer_config* config, MPI_Comm comm, kmoe_layer** layer);
/** The same with a Fortran communicator handle. */
kmoe_status kmoe_layer_create_f(const kmoe_layer_config* config, MPI_Fint comm, kmoe_layer** layer);
/** Collective: frees the layer (NULL is accepted). */
kmoe_status kmoe_layer_destroy(kmoe_layer* layer);

/** Collective over the layer's communicator: every rank says whether its
 *  arguments for a collective call are fine (ok != 0) or what is wrong with
 *  them (ok == 0, message). When any rank has a problem, every rank returns
 *  KMOE_ERROR_INVALID_ARGUMENT with the same message (the lowest failing
 *  rank's); otherwise KMOE_SUCCESS. For wrappers that check more than the C
 *  call can see (a Fortran output array's shape, say). */
kmoe_status kmoe_layer_check(kmoe_layer* layer, int ok, const char* message);

/** Records `message` as this thread's last error and returns `status`: for
 *  wrappers that refuse arguments before calling in (a Fortran array pair of
 *  two sizes, say), so that their callers read every error the same way. */
kmoe_status kmoe_report_error(kmoe_status status, const char* message);

/** The layer's shape: any pointer may be NULL. */
kmoe_status kmoe_layer_shape(const kmoe_layer* layer, int64_t* hidden, int32_t* experts, int32_t* top_k,
                             kmoe_dtype* dtype, int64_t* tokens_per_rank);

/** Collective: out[tokens][hidden] = the layer applied to this rank's rows
 *  hidden[tokens][hidden] (dtype: the layer's; memory: where both arrays
 *  are). Host arrays are used in place on host builds (no copy). */
kmoe_status kmoe_layer_forward(kmoe_layer* layer, const void* hidden, int64_t tokens, int64_t hidden_dim, kmoe_dtype dtype,
                               kmoe_memory memory, void* out);

/** Collective: the backward of the last forward, which must have been on
 *  the same rows `hidden`: dx[tokens][hidden] = the gradient of the
 *  objective with respect to hidden, given dout (its gradient with respect
 *  to the forward's output). The parameter gradients are kept in the layer
 *  (kmoe_layer_get_gradient, kmoe_layer_gradient_storage,
 *  kmoe_layer_gradient_norm); a replicated expert's copies each hold the
 *  sum over all of them. The deck's [train] gradient_block and
 *  reproducible_shared apply. fp32 layers. */
kmoe_status kmoe_layer_backward(kmoe_layer* layer, const void* hidden, const void* dout, int64_t tokens, int64_t hidden_dim,
                                kmoe_dtype dtype, kmoe_memory memory, void* dx);

/** Collective: the L2 norm of the parameter gradients of the last backward
 *  (router, shared experts, every routed expert once however many copies
 *  it has; the same on every rank). */
kmoe_status kmoe_layer_gradient_norm(kmoe_layer* layer, double* norm);

/** This rank's rows of step `step` of the layer's deck ([tokens] source and
 *  seed): the rows kmoe-layer feeds the layer (host array of the layer's
 *  dtype, [tokens_per_rank][hidden]). */
kmoe_status kmoe_layer_deck_rows(const kmoe_layer* layer, int32_t step, void* hidden, int64_t tokens, int64_t hidden_dim);

/** Collective: a content digest (16 hex digits and a NUL) of every rank's
 *  rows out[tokens][hidden] in rank order, the same on every rank (the
 *  output_digest of kmoe-layer's reports). out is host memory or, in CUDA
 *  builds, device memory (recognized by the CUDA runtime). */
kmoe_status kmoe_layer_digest(kmoe_layer* layer, const void* out, int64_t tokens, int64_t hidden_dim, char digest[17]);

/** Collective: writes / reads the routed experts' weights (parallel HDF5). */
kmoe_status kmoe_layer_save_weights(kmoe_layer* layer, const char* path);
kmoe_status kmoe_layer_load_weights(kmoe_layer* layer, const char* path);

/** The last forward on this rank. */
kmoe_status kmoe_layer_last_step(const kmoe_layer* layer, kmoe_step_summary* summary);
/** The last forward as JSON (ledger by stage and link class, stage times,
 *  tasks); `needed` gets the size with the NUL. */
kmoe_status kmoe_layer_last_step_json(const kmoe_layer* layer, char* buffer, size_t size, size_t* needed);
/** Every rank's host, node, relay and peer slots as JSON. */
kmoe_status kmoe_layer_topology_json(const kmoe_layer* layer, char* buffer, size_t size, size_t* needed);
/** The placement: for each physical slot its logical expert and rank (arrays
 *  of `capacity` entries); num_slots gets the slot count. */
kmoe_status kmoe_layer_placement(const kmoe_layer* layer, int32_t* slot_expert, int32_t* slot_rank, int32_t capacity,
                                 int32_t* num_slots);

/* ---- parameters and gradients --------------------------------------------- */

/** A layer's parameter tensors (one tensor per index):
 *    KMOE_ROUTER_WEIGHT    index 0                  [experts][hidden]
 *    KMOE_CORRECTION_BIAS  index 0                  [experts]   (routers with a correction bias)
 *    KMOE_EXPERT_GATE/UP   global expert id         [ffn][hidden]
 *    KMOE_EXPERT_DOWN      global expert id         [hidden][ffn]
 *    KMOE_SHARED_GATE/UP   shared expert index      [shared ffn][hidden]
 *    KMOE_SHARED_DOWN      shared expert index      [hidden][shared ffn]
 *  Row-major fp32 values; a bf16 layer rounds what it is given to bf16. */
typedef enum kmoe_parameter {
  KMOE_ROUTER_WEIGHT = 0,
  KMOE_CORRECTION_BIAS = 1,
  KMOE_EXPERT_GATE = 2,
  KMOE_EXPERT_UP = 3,
  KMOE_EXPERT_DOWN = 4,
  KMOE_SHARED_GATE = 5,
  KMOE_SHARED_UP = 6,
  KMOE_SHARED_DOWN = 7
} kmoe_parameter;

/** The name of a parameter ("router_weight", "expert_gate", ...; "" for none). */
const char* kmoe_parameter_name(kmoe_parameter parameter);

/** How many tensors `parameter` has (count: 1, the experts, the shared
 *  experts, or 0 where the layer has none) and the shape of one (ndim 1 or
 *  2, shape[0..ndim-1]); any pointer may be NULL. */
kmoe_status kmoe_layer_parameter_info(const kmoe_layer* layer, kmoe_parameter parameter, int32_t* count, int32_t* ndim,
                                      int64_t shape[2]);

/** Collective: tensor `index` of `parameter` into values[count] (count: its
 *  elements), the same on every rank. A routed expert comes from the lowest
 *  rank that holds a copy. */
kmoe_status kmoe_layer_get_parameter(kmoe_layer* layer, kmoe_parameter parameter, int32_t index, float* values, int64_t count);

/** Collective: sets tensor `index` of `parameter` from values[count].
 *  Router weight, correction bias, shared experts: every rank passes the
 *  same values. A routed expert: every rank holding a copy of it passes the
 *  same values (all its copies are written); the other ranks may pass NULL
 *  and 0. Values must be finite. On any error nothing changes on any rank. */
kmoe_status kmoe_layer_set_parameter(kmoe_layer* layer, kmoe_parameter parameter, int32_t index, const float* values,
                                     int64_t count);

/** Collective: the gradient of tensor `index` of `parameter` from the last
 *  backward, the same on every rank: the router weight's and the shared
 *  experts' summed over the ranks, a routed expert's summed over its
 *  replicas. The correction bias has none. */
kmoe_status kmoe_layer_get_gradient(kmoe_layer* layer, kmoe_parameter parameter, int32_t index, float* values, int64_t count);

/** This rank's storage of `parameter`, in place (no copy): the router weight
 *  [experts][hidden] and correction bias [experts] (every rank's own copy),
 *  this rank's routed expert slots [slots][rows][cols] (slot q holds global
 *  expert kmoe_layer_local_experts()[q]), the shared experts
 *  [shared][rows][cols]. Elements of `dtype` (the layer's; bias: fp32) in
 *  `memory`. Writes through it are the layer's weights from the next
 *  forward on; keep every copy of a tensor the same on every rank. Valid
 *  until the layer is destroyed. */
kmoe_status kmoe_layer_parameter_storage(kmoe_layer* layer, kmoe_parameter parameter, void** data, int32_t* ndim, int64_t shape[3],
                                         kmoe_dtype* dtype, kmoe_memory* memory);

/** This rank's fp32 gradient storage of `parameter` (fp32 layers), laid out
 *  as kmoe_layer_parameter_storage's, filled by each backward (routed slots:
 *  their expert's total over replicas; router and shared experts: summed
 *  over the ranks). Valid until the layer is destroyed. */
kmoe_status kmoe_layer_gradient_storage(kmoe_layer* layer, kmoe_parameter parameter, float** data, int32_t* ndim, int64_t shape[3],
                                        kmoe_memory* memory);

/** The global expert id of each of this rank's routed slots (experts[count];
 *  experts NULL: count only). */
kmoe_status kmoe_layer_local_experts(const kmoe_layer* layer, int32_t* experts, int32_t capacity, int32_t* count);

/* ---- placement ----------------------------------------------------------- */

/** EPLB: a placement of num_experts experts with loads[e] on num_slots slots
 *  (a multiple of num_ranks, extra slots hold replicas of the heaviest) over
 *  num_ranks ranks on num_nodes nodes (groups: expert groups kept on one
 *  node, 1 for none). slot_expert and slot_rank have num_slots entries. */
kmoe_status kmoe_eplb(const double* loads, int32_t num_experts, int32_t num_slots, int32_t num_ranks, int32_t num_nodes,
                      int32_t groups, int32_t* slot_expert, int32_t* slot_rank);

#ifdef __cplusplus
}
#endif

#endif
