/* A C program built against the installed library through pkg-config only:
 *   mpicc c_consumer.c $(pkg-config --cflags --libs kokkosmoe)
 * A layer from a configuration, one forward, the step summary. */
#include <kmoe.h>

#include <stdio.h>
#include <string.h>

int main(int argc, char** argv) {
  if (kmoe_initialize(&argc, &argv) != KMOE_SUCCESS) {
    fprintf(stderr, "c consumer: %s\n", kmoe_last_error());
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  kmoe_layer_config cfg = kmoe_layer_config_default();
  cfg.hidden = 16;
  cfg.ffn = 24;
  cfg.tokens_per_rank = 8;
  kmoe_layer* layer = NULL;
  float x[8 * 16], y[8 * 16];
  for (int i = 0; i < 8 * 16; ++i) x[i] = (float)(i % 5) / 4.0f - 0.5f;
  kmoe_step_summary s;
  int ok = kmoe_layer_create(&cfg, MPI_COMM_WORLD, &layer) == KMOE_SUCCESS &&
           kmoe_layer_forward(layer, x, 8, 16, KMOE_FP32, KMOE_HOST, y) == KMOE_SUCCESS &&
           kmoe_layer_last_step(layer, &s) == KMOE_SUCCESS && s.routes_attempted == 8 * cfg.top_k;
  if (!ok) fprintf(stderr, "c consumer (rank %d): %s\n", rank, kmoe_last_error());
  kmoe_layer_destroy(layer);
  if (rank == 0 && ok) printf("c consumer ok: KokkosMoE %s\n", kmoe_version());
  kmoe_finalize();
  return ok ? 0 : 1;
}
