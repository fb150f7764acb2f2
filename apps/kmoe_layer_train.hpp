#ifndef KMOE_LAYER_TRAIN_HPP
#define KMOE_LAYER_TRAIN_HPP

// kmoe-layer with [run] mode = "train": the deck's layer (the student)
// trained toward a teacher layer of the same shape (KokkosMoE_Train.hpp).

#include <KokkosMoE_Deck.hpp>

#include <string>

namespace kmoe_layer {

/// What the command line overrides of a training run.
struct TrainOptions {
  int steps = -1;      ///< steps (-1: [run] steps)
  std::string report;  ///< JSON report path ("": [run] report)
  std::string hdf5;    ///< HDF5 time series path ("": [run] hdf5)
};

/// Runs the training steps (collective over MPI_COMM_WORLD); prints a
/// progress line per tenth of the run and ends with
/// TRAIN steps=N ... loss_first=... loss_last=... loss_ratio=...
int train(KokkosMoE::LayerDeck const& deck, TrainOptions const& opt);

}  // namespace kmoe_layer

#endif
