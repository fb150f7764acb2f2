/* The C interface from C: every call's status and message, on every rank,
 * for the error paths (a call before initialization, NULL pointers, a bad
 * deck, wrong shapes and dtypes, a buffer too small, bad EPLB arguments) and
 * for a forward that works (shape, ledger summary, JSON, placement, digest,
 * weights round trip). Exit code 0 when every check passed on every rank.
 *
 *   mpiexec -n 2 test_c_api <repository>/inputs/quickstart.toml <scratch folder>
 */

#include <kmoe.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
static int rank = 0;

#define EXPECT(cond, what)                                                              \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      ++failures;                                                                       \
      fprintf(stderr, "rank %d: FAILED %s (line %d): %s\n", rank, what, __LINE__, #cond); \
    }                                                                                   \
  } while (0)

/* A call's status and that its message contains `text`. */
#define EXPECT_STATUS(call, status, text)                                                                 \
  do {                                                                                                    \
    kmoe_status const st_ = (call);                                                                       \
    if (st_ != (status) || strstr(kmoe_last_error(), (text)) == NULL) {                                   \
      ++failures;                                                                                         \
      fprintf(stderr, "rank %d: FAILED line %d: %s returned %d (expected %d), message '%s' (expected '%s')\n", rank, \
              __LINE__, #call, (int)st_, (int)(status), kmoe_last_error(), (text));                      \
    }                                                                                                     \
  } while (0)

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: test_c_api <deck.toml> <scratch folder>\n");
    return 2;
  }
  char const* deck = argv[1];
  char weights[4096];
  snprintf(weights, sizeof weights, "%s/c_api_weights.h5", argv[2]);

  /* Before initialization. */
  kmoe_layer* layer = NULL;
  EXPECT(kmoe_is_initialized() == 0, "not initialized at start");
  EXPECT_STATUS(kmoe_layer_shape(NULL, NULL, NULL, NULL, NULL, NULL), KMOE_ERROR_NOT_INITIALIZED, "call kmoe_initialize first");
  EXPECT_STATUS(kmoe_finalize(), KMOE_ERROR_NOT_INITIALIZED, "not initialized");

  EXPECT_STATUS(kmoe_initialize(&argc, &argv), KMOE_SUCCESS, "");
  EXPECT(kmoe_is_initialized() == 1, "initialized");
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT(strcmp(kmoe_version(), "") != 0, "a version");
  EXPECT(strstr(kmoe_build_configuration(), "\"kokkos_flavor\"") != NULL, "build configuration JSON");

  /* Layer creation errors: the same status and message on every rank. */
  EXPECT_STATUS(kmoe_layer_create_from_deck(NULL, MPI_COMM_WORLD, &layer), KMOE_ERROR_INVALID_ARGUMENT, "deck_path is NULL");
  EXPECT_STATUS(kmoe_layer_create_from_deck(deck, MPI_COMM_WORLD, NULL), KMOE_ERROR_INVALID_ARGUMENT, "the layer pointer is NULL");
  EXPECT_STATUS(kmoe_layer_create_from_deck("/nonexistent/deck.toml", MPI_COMM_WORLD, &layer), KMOE_ERROR_INPUT,
                "/nonexistent/deck.toml");
  /* A NULL deck path on one rank only: every rank reports rank 1's problem. */
  if (size > 1)
    EXPECT_STATUS(kmoe_layer_create_from_deck(rank == 1 ? NULL : deck, MPI_COMM_WORLD, &layer), KMOE_ERROR_INVALID_ARGUMENT,
                  "deck_path is NULL");
  kmoe_layer_config bad = kmoe_layer_config_default();
  bad.top_k = 99;
  EXPECT_STATUS(kmoe_layer_create(&bad, MPI_COMM_WORLD, &layer), KMOE_ERROR_INPUT, "model.top_k");
  bad = kmoe_layer_config_default();
  bad.dtype = (kmoe_dtype)7;
  EXPECT_STATUS(kmoe_layer_create(&bad, MPI_COMM_WORLD, &layer), KMOE_ERROR_INVALID_ARGUMENT, "neither KMOE_FP32 nor KMOE_BF16");
  EXPECT(layer == NULL, "no layer after failures");

  /* A layer from a configuration, and a forward. */
  kmoe_layer_config cfg = kmoe_layer_config_default();
  cfg.hidden = 32;
  cfg.experts = 4 * size;
  cfg.top_k = 2;
  cfg.ffn = 48;
  cfg.tokens_per_rank = 16;
  cfg.nodes = size > 1 ? 2 : 1;
  cfg.algorithm = "hierarchical";
  EXPECT_STATUS(kmoe_layer_create(&cfg, MPI_COMM_WORLD, &layer), KMOE_SUCCESS, "");
  if (layer == NULL) {
    kmoe_finalize();
    return 1;
  }
  int64_t hidden = 0, tokens = 0;
  int32_t experts = 0, top_k = 0;
  kmoe_dtype dtype = KMOE_BF16;
  EXPECT_STATUS(kmoe_layer_shape(layer, &hidden, &experts, &top_k, &dtype, &tokens), KMOE_SUCCESS, "");
  EXPECT(hidden == 32 && experts == 4 * size && top_k == 2 && dtype == KMOE_FP32 && tokens == 16, "shape");
  float* x = (float*)malloc(sizeof(float) * 16 * 32);
  float* y = (float*)malloc(sizeof(float) * 16 * 32);
  float* y2 = (float*)malloc(sizeof(float) * 16 * 32);
  for (int i = 0; i < 16 * 32; ++i) x[i] = (float)((i * 7 + rank * 3) % 13 - 6) / 8.0f;
  kmoe_step_summary sum;
  EXPECT_STATUS(kmoe_layer_last_step(layer, &sum), KMOE_ERROR_INVALID_ARGUMENT, "has not run a forward yet");
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 32, KMOE_FP32, KMOE_HOST, y), KMOE_SUCCESS, "");
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 32, KMOE_FP32, KMOE_HOST, y2), KMOE_SUCCESS, "");
  EXPECT(memcmp(y, y2, sizeof(float) * 16 * 32) == 0, "two forwards give the same bits");
  double norm = 0;
  for (int i = 0; i < 16 * 32; ++i) norm += (double)y[i] * y[i];
  EXPECT(norm > 0 && isfinite(norm), "a finite, non-zero output");
  EXPECT_STATUS(kmoe_layer_last_step(layer, &sum), KMOE_SUCCESS, "");
  EXPECT(sum.tokens == 16 && sum.routes_attempted == 32 && sum.routes_accepted + sum.routes_dropped == 32, "summary routes");
  EXPECT(sum.seconds_total > 0 && sum.dispatch_rows > 0, "summary times and rows");

  /* Forward errors: the same on every rank, nothing written. */
  memset(y2, 0, sizeof(float) * 16 * 32);
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 31, KMOE_FP32, KMOE_HOST, y2), KMOE_ERROR_INVALID_ARGUMENT,
                "rows of 31 elements, the layer's hidden width is 32");
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 32, KMOE_BF16, KMOE_HOST, y2), KMOE_ERROR_INVALID_ARGUMENT,
                "bf16 rows, the layer computes in fp32");
  EXPECT_STATUS(kmoe_layer_forward(layer, NULL, 16, 32, KMOE_FP32, KMOE_HOST, y2), KMOE_ERROR_INVALID_ARGUMENT, "hidden is NULL");
  EXPECT_STATUS(kmoe_layer_forward(layer, x, -1, 32, KMOE_FP32, KMOE_HOST, y2), KMOE_ERROR_INVALID_ARGUMENT, "is negative");
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 32, KMOE_FP32, (kmoe_memory)5, y2), KMOE_ERROR_INVALID_ARGUMENT,
                "neither KMOE_HOST nor KMOE_DEVICE");
  if (size > 1)
    EXPECT_STATUS(kmoe_layer_forward(layer, rank == size - 1 ? NULL : x, 16, 32, KMOE_FP32, KMOE_HOST, y2),
                  KMOE_ERROR_INVALID_ARGUMENT, "hidden is NULL");
  EXPECT_STATUS(kmoe_layer_check(layer, rank != 0, "rank 0 refuses"), KMOE_ERROR_INVALID_ARGUMENT, "rank 0 refuses (rank 0)");
  EXPECT_STATUS(kmoe_layer_check(layer, 1, NULL), KMOE_SUCCESS, "");
  int zeros = 1;
  for (int i = 0; i < 16 * 32; ++i) zeros = zeros && y2[i] == 0.0f;
  EXPECT(zeros, "a refused forward writes nothing");
  /* Zero tokens on every rank is a forward too. */
  EXPECT_STATUS(kmoe_layer_forward(layer, NULL, 0, 32, KMOE_FP32, KMOE_HOST, NULL), KMOE_SUCCESS, "");

  /* Backward of the last forward (on x): dx and a gradient norm, the same on every rank. */
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 32, KMOE_FP32, KMOE_HOST, y), KMOE_SUCCESS, "");
  {
    float* dx = (float*)malloc(sizeof(float) * 16 * 32);
    double gn = -1;
    EXPECT_STATUS(kmoe_layer_gradient_norm(layer, &gn), KMOE_ERROR_INVALID_ARGUMENT, "has not run a backward yet");
    EXPECT_STATUS(kmoe_layer_backward(layer, x, y, 16, 32, KMOE_FP32, KMOE_HOST, dx), KMOE_SUCCESS, "");
    double dnorm = 0;
    for (int i = 0; i < 16 * 32; ++i) dnorm += (double)dx[i] * dx[i];
    EXPECT(dnorm > 0 && isfinite(dnorm), "a finite, non-zero input gradient");
    EXPECT_STATUS(kmoe_layer_gradient_norm(layer, &gn), KMOE_SUCCESS, "");
    double lo = gn, hi = gn;
    MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    EXPECT(gn > 0 && lo == hi, "a gradient norm, the same on every rank");
    EXPECT_STATUS(kmoe_layer_backward(layer, x, y, 16, 31, KMOE_FP32, KMOE_HOST, dx), KMOE_ERROR_INVALID_ARGUMENT,
                  "rows of 31 elements");
    EXPECT_STATUS(kmoe_layer_backward(layer, x, NULL, 16, 32, KMOE_FP32, KMOE_HOST, dx), KMOE_ERROR_INVALID_ARGUMENT, "dout is NULL");
    free(dx);
  }

  /* Parameters and gradients by name and global expert id. */
  {
    int32_t count = -1, nd = 0;
    int64_t shp[2] = {0, 0};
    EXPECT_STATUS(kmoe_layer_parameter_info(layer, KMOE_EXPERT_DOWN, &count, &nd, shp), KMOE_SUCCESS, "");
    EXPECT(count == 4 * size && nd == 2 && shp[0] == 32 && shp[1] > 0, "expert_down: one tensor per expert, [hidden][ffn]");
    EXPECT(strcmp(kmoe_parameter_name(KMOE_SHARED_UP), "shared_up") == 0, "parameter names");
    int64_t const n = shp[0] * shp[1];
    float* v = (float*)malloc(sizeof(float) * (size_t)n);
    float* g = (float*)malloc(sizeof(float) * (size_t)n);
    int32_t nl = 0, local[64];
    EXPECT_STATUS(kmoe_layer_local_experts(layer, local, 64, &nl), KMOE_SUCCESS, "");
    EXPECT(nl == 4, "four local experts");
    int32_t const e = 4 * size - 1;
    int q_of_e = -1;
    for (int q = 0; q < nl; ++q)
      if (local[q] == e) q_of_e = q;
    EXPECT_STATUS(kmoe_layer_get_parameter(layer, KMOE_EXPERT_DOWN, e, v, n), KMOE_SUCCESS, "");
    void* data = NULL;
    int32_t snd = 0;
    int64_t ss[3] = {0, 0, 0};
    kmoe_dtype sdt = KMOE_BF16;
    kmoe_memory smem = KMOE_DEVICE;
    EXPECT_STATUS(kmoe_layer_parameter_storage(layer, KMOE_EXPERT_DOWN, &data, &snd, ss, &sdt, &smem), KMOE_SUCCESS, "");
    EXPECT(snd == 3 && ss[0] == nl && ss[1] * ss[2] == n && sdt == KMOE_FP32 && smem == KMOE_HOST, "expert_down storage");
    if (q_of_e >= 0) EXPECT(memcmp((float*)data + q_of_e * n, v, sizeof(float) * (size_t)n) == 0, "the owner's storage is the expert");
    for (int64_t i = 0; i < n; ++i) v[i] *= 2.0f;
    EXPECT_STATUS(kmoe_layer_set_parameter(layer, KMOE_EXPERT_DOWN, e, q_of_e >= 0 ? v : NULL, q_of_e >= 0 ? n : 0), KMOE_SUCCESS, "");
    EXPECT_STATUS(kmoe_layer_get_parameter(layer, KMOE_EXPERT_DOWN, e, g, n), KMOE_SUCCESS, "");
    EXPECT(memcmp(g, v, sizeof(float) * (size_t)n) == 0, "set then get: the same values on every rank");
    if (q_of_e >= 0) EXPECT(memcmp((float*)data + q_of_e * n, v, sizeof(float) * (size_t)n) == 0, "set writes the storage");
    EXPECT_STATUS(kmoe_layer_set_parameter(layer, (kmoe_parameter)9, 0, v, n), KMOE_ERROR_INVALID_ARGUMENT, "is not a kmoe_parameter");
    EXPECT_STATUS(kmoe_layer_get_parameter(layer, KMOE_EXPERT_DOWN, 4 * size, v, n), KMOE_ERROR_INVALID_ARGUMENT, "is outside 0..");
    EXPECT_STATUS(kmoe_layer_get_parameter(layer, KMOE_EXPERT_DOWN, e, v, n - 1), KMOE_ERROR_INVALID_ARGUMENT, "count is");
    EXPECT_STATUS(kmoe_layer_get_gradient(layer, KMOE_CORRECTION_BIAS, 0, v, 4 * size), KMOE_ERROR_INVALID_ARGUMENT, "no correction bias");
    /* A non-finite router weight on one rank: refused on every rank, nothing written. */
    float* r = (float*)malloc(sizeof(float) * 4 * (size_t)size * 32);
    float* r2 = (float*)malloc(sizeof(float) * 4 * (size_t)size * 32);
    EXPECT_STATUS(kmoe_layer_get_parameter(layer, KMOE_ROUTER_WEIGHT, 0, r, 4 * size * 32), KMOE_SUCCESS, "");
    float const keep = r[5];
    if (rank == 0) r[5] = NAN;
    EXPECT_STATUS(kmoe_layer_set_parameter(layer, KMOE_ROUTER_WEIGHT, 0, r, 4 * size * 32), KMOE_ERROR_INVALID_ARGUMENT, "value 5 is nan");
    EXPECT_STATUS(kmoe_layer_get_parameter(layer, KMOE_ROUTER_WEIGHT, 0, r2, 4 * size * 32), KMOE_SUCCESS, "");
    EXPECT(r2[5] == keep, "a refused set changes nothing");
    free(r);
    free(r2);
    /* The gradient of the last backward: the owner's storage, on every rank. */
    EXPECT_STATUS(kmoe_layer_get_gradient(layer, KMOE_EXPERT_DOWN, e, g, n), KMOE_SUCCESS, "");
    float* gd = NULL;
    EXPECT_STATUS(kmoe_layer_gradient_storage(layer, KMOE_EXPERT_DOWN, &gd, &snd, ss, &smem), KMOE_SUCCESS, "");
    if (q_of_e >= 0) EXPECT(memcmp(gd + q_of_e * n, g, sizeof(float) * (size_t)n) == 0, "get_gradient is the owner's gradient");
    EXPECT_STATUS(kmoe_layer_gradient_storage(layer, KMOE_CORRECTION_BIAS, &gd, &snd, ss, &smem), KMOE_ERROR_INVALID_ARGUMENT,
                  "has no gradient");
    free(v);
    free(g);
  }

  /* JSON and placement queries. */
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 32, KMOE_FP32, KMOE_HOST, y), KMOE_SUCCESS, "");
  size_t needed = 0;
  EXPECT_STATUS(kmoe_layer_last_step_json(layer, NULL, 0, &needed), KMOE_SUCCESS, "");
  char small[8];
  EXPECT_STATUS(kmoe_layer_last_step_json(layer, small, sizeof small, &needed), KMOE_ERROR_BUFFER_TOO_SMALL, "the text needs");
  char* text = (char*)malloc(needed);
  EXPECT_STATUS(kmoe_layer_last_step_json(layer, text, needed, NULL), KMOE_SUCCESS, "");
  EXPECT(strstr(text, "\"algorithm\":\"hierarchical\"") != NULL && strstr(text, "\"ledger\"") != NULL, "step JSON");
  free(text);
  EXPECT_STATUS(kmoe_layer_topology_json(layer, NULL, 0, &needed), KMOE_SUCCESS, "");
  EXPECT(needed > 2, "topology JSON size");
  int32_t slots = 0;
  EXPECT_STATUS(kmoe_layer_placement(layer, NULL, NULL, 0, &slots), KMOE_SUCCESS, "");
  EXPECT(slots == 4 * size, "slot count");
  int32_t se[64], sr[64];
  EXPECT_STATUS(kmoe_layer_placement(layer, se, sr, 1, &slots), KMOE_ERROR_BUFFER_TOO_SMALL, "arrays of 1 entries");
  EXPECT_STATUS(kmoe_layer_placement(layer, se, sr, 64, &slots), KMOE_SUCCESS, "");
  int placed = 1;
  for (int s = 0; s < slots; ++s) placed = placed && se[s] >= 0 && se[s] < 4 * size && sr[s] >= 0 && sr[s] < size;
  EXPECT(placed, "placement entries in range");

  /* Digest: the same on every rank, and it changes with the rows. */
  char d1[17], d2[17];
  EXPECT_STATUS(kmoe_layer_digest(layer, y, 16, 32, d1), KMOE_SUCCESS, "");
  float const y0 = y[0];
  y[0] += 1.0f;
  EXPECT_STATUS(kmoe_layer_digest(layer, y, 16, 32, d2), KMOE_SUCCESS, "");
  y[0] = y0;
  EXPECT(strlen(d1) == 16 && strcmp(d1, d2) != 0, "digests");
  EXPECT_STATUS(kmoe_layer_deck_rows(layer, 0, x, 16, 31), KMOE_ERROR_INVALID_ARGUMENT, "the deck gives 16 x 32");

  /* Weights: a round trip, and a missing file on every rank. */
  EXPECT_STATUS(kmoe_layer_save_weights(layer, weights), KMOE_SUCCESS, "");
  EXPECT_STATUS(kmoe_layer_load_weights(layer, weights), KMOE_SUCCESS, "");
  EXPECT_STATUS(kmoe_layer_forward(layer, x, 16, 32, KMOE_FP32, KMOE_HOST, y2), KMOE_SUCCESS, "");
  EXPECT(memcmp(y, y2, sizeof(float) * 16 * 32) == 0, "the same output after a weights round trip");
  EXPECT_STATUS(kmoe_layer_load_weights(layer, "/nonexistent/weights.h5"), KMOE_ERROR_INPUT, "/nonexistent/weights.h5");
  EXPECT_STATUS(kmoe_layer_save_weights(layer, NULL), KMOE_ERROR_INVALID_ARGUMENT, "path is NULL");

  /* EPLB from a load vector. */
  double loads[8] = {10, 1, 1, 1, 1, 1, 1, 4};
  int32_t pe[16], pr[16];
  EXPECT_STATUS(kmoe_eplb(loads, 8, 16, 4, 2, 1, pe, pr), KMOE_SUCCESS, "");
  int hot = 0;
  for (int s = 0; s < 16; ++s) hot += pe[s] == 0;
  EXPECT(hot >= 2, "the hot expert is replicated");
  EXPECT_STATUS(kmoe_eplb(loads, 8, 6, 4, 2, 1, pe, pr), KMOE_ERROR_INPUT, "");
  EXPECT_STATUS(kmoe_eplb(NULL, 8, 16, 4, 2, 1, pe, pr), KMOE_ERROR_INVALID_ARGUMENT, "loads is NULL");
  EXPECT_STATUS(kmoe_eplb(loads, 0, 16, 4, 2, 1, pe, pr), KMOE_ERROR_INVALID_ARGUMENT, "must all be >= 1");

  EXPECT_STATUS(kmoe_layer_destroy(layer), KMOE_SUCCESS, "");
  EXPECT_STATUS(kmoe_layer_destroy(NULL), KMOE_SUCCESS, "");

  /* A deck layer. */
  EXPECT_STATUS(kmoe_layer_create_from_deck(deck, MPI_COMM_WORLD, &layer), KMOE_SUCCESS, "");
  EXPECT_STATUS(kmoe_layer_destroy(layer), KMOE_SUCCESS, "");

  free(x);
  free(y);
  free(y2);
  int all = 0;
  MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_STATUS(kmoe_finalize(), KMOE_SUCCESS, "");
  EXPECT_STATUS(kmoe_layer_shape(NULL, NULL, NULL, NULL, NULL, NULL), KMOE_ERROR_NOT_INITIALIZED, "call kmoe_initialize first");
  if (rank == 0) printf("test_c_api: %s (%d failed checks over all ranks)\n", all == 0 ? "all checks passed" : "FAILED", all);
  return all == 0 && failures == 0 ? 0 : 1;
}
