#ifndef KMOE_LAYER_SERVE_HPP
#define KMOE_LAYER_SERVE_HPP

// kmoe-layer with [run] mode = "serve": the deck's [[serve.step]] sequence
// on a decode bucket (KokkosMoE_Serve.hpp).

#include <KokkosMoE_Deck.hpp>

#include <string>

namespace kmoe_layer {

/// Runs the serve steps of a deck (collective over MPI_COMM_WORLD); writes
/// the report to report_path ("" none). Returns 0, or 1 when serve.check
/// found a step whose output differs from the ordinary path's.
int serve(KokkosMoE::LayerDeck const& deck, std::string const& report_path);

}  // namespace kmoe_layer

#endif
