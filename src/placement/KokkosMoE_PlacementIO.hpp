#ifndef KOKKOSMOE_PLACEMENTIO_HPP
#define KOKKOSMOE_PLACEMENTIO_HPP

/// \file KokkosMoE_PlacementIO.hpp
/// \brief Files of the placement tools: expert loads (JSON or HDF5) and
/// placement slot lists (JSON).
///
/// Load files ([L][E] loads, numbers >= 0):
///  - JSON: {"layers": [{"load": [l_0, ..., l_{E-1}]}, ...]} or, for one
///    layer, {"load": [...]}; an optional "provenance" object (as written by
///    LoadEstimate::to_json) is accepted and ignored. Any other key is an error.
///  - HDF5: dataset "/load" of shape [L, E] or [E], any integer or floating
///    type (read as double). Recognized by the HDF5 signature, not the name.
///
/// Placement files (JSON), slot id = position in the "slots" list:
///   {"format": "kokkosmoe-placement", "experts": E, "ranks": R,
///    "generation": g, "layers": [{"slots": [{"expert": e, "rank": r,
///    "node": n, "replica": j, "version": v, "digest": "16 hex digits"}, ...]}]}
/// or {"experts": E, "ranks": R, "slots": [...]} for one layer. In a slot
/// only "expert" and "rank" are required (node -1, replica -1, version 0 and
/// digest 0 by default); "format" and "generation" are optional.

#include <KokkosMoE_Placement.hpp>

#include <mpi.h>

#include <string>
#include <vector>

namespace KokkosMoE {

/// \brief Parses a JSON load text; `origin` names the file in errors.
/// Throws Error naming origin, the layer and the key for anything malformed.
std::vector<std::vector<double>> load_matrix_from_json(std::string const& text, std::string const& origin);

/// \brief Collective over comm: reads a load file (JSON: rank 0 reads and
/// broadcasts the text; HDF5: opened collectively with the MPI-IO driver).
/// Every rank returns the same matrix or throws the same Error.
std::vector<std::vector<double>> read_load_matrix(MPI_Comm comm, std::string const& path);

/// \brief Collective over comm: writes load ([L][E]) as dataset "/load"
/// [L, E] (double) of a new HDF5 file. Throws Error when this build has no HDF5.
void write_load_matrix_hdf5(MPI_Comm comm, std::string const& path, std::vector<std::vector<double>> const& load);

/// \brief True when this build can read and write HDF5 load files.
bool have_hdf5();

/// \brief JSON text of one placement per layer (all with the same experts and ranks).
std::string placements_to_json(std::vector<Placement> const& layers, int indent = 2);

/// \brief Parses a placement file text (see the format above). node_of_rank
/// (optional, [ranks]) fills and checks the slots' nodes.
std::vector<Placement> placements_from_json(std::string const& text, std::string const& origin,
                                            std::vector<int> const& node_of_rank = {});

/// \brief Collective over comm: rank 0 reads the text file at path and
/// broadcasts it; throws the same Error on every rank when it cannot be read.
std::string read_text_file(MPI_Comm comm, std::string const& path, char const* what = "file");

}  // namespace KokkosMoE

#endif
