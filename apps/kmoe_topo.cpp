// kmoe-topo: where every rank runs and how the expert-parallel communicators
// see it.
//
//   mpiexec -n 8 kmoe-topo [--layout virtual --ranks-per-node 4 --relays-per-node 2]
//                          [--peer-order 2,0,3,1] [--json topo.json] [--export-xml node.xml]
//   mpiexec -n 4 kmoe-topo --deck inputs/quickstart.toml
//
// Prints one line per rank (host, node, local rank, NUMA, cores, GPU, NIC,
// relay, peer slot in the EP, node-local and relay communicators), writes the
// same as JSON, and can export the hwloc XML of the node (or of the synthetic
// description).

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Deck.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>

#include "kmoe_app.hpp"

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdio>
#include <iostream>

int main(int argc, char* argv[]) {
  using namespace KokkosMoE;
  return kmoe_app::run(argc, argv, "kmoe-topo", [&](int rank) {
    CLI::App app{"kmoe-topo: ranks, nodes, relays and peer slots"};
    std::string deck_path, layout = "hwloc", synthetic, xml, json_path, export_path, relay_policy = "lowest_local_rank";
    int ranks_per_node = 0, relays = 1;
    std::vector<int> node_of_rank, peer_order;
    app.add_option("--deck", deck_path, "take the [topology] table of a deck");
    app.add_option("--layout", layout, "hwloc, virtual or synthetic")->check(CLI::IsMember(enum_names<Topology::LayoutKind>()));
    app.add_option("--ranks-per-node", ranks_per_node, "virtual/synthetic nodes of consecutive ranks")->check(CLI::PositiveNumber);
    app.add_option("--node-of-rank", node_of_rank, "node of every rank")->delimiter(',');
    app.add_option("--synthetic", synthetic, "hwloc synthetic description of a node");
    app.add_option("--xml", xml, "hwloc XML file of a node");
    app.add_option("--peer-order", peer_order, "EP peer order (a permutation of the ranks)")->delimiter(',');
    app.add_option("--relays-per-node", relays, "relays per node (> 1: rail relays)")->check(CLI::PositiveNumber);
    app.add_option("--relay-policy", relay_policy, "lowest_local_rank or nearest_nic")->check(CLI::IsMember(enum_names<Topology::RelayPolicy>()));
    app.add_option("--json", json_path, "write the table as JSON");
    app.add_option("--export-xml", export_path, "write this node's hwloc XML (rank 0)");
    if (int const rc = kmoe_app::parse(app, argc, argv, rank); rc >= 0) return rc;
    Topology::LayoutSpec spec;
    Topology::CommSpec cspec;
    if (!deck_path.empty()) {
      auto const deck = read_layer_deck(MPI_COMM_WORLD, deck_path);
      spec = Setup::layout_spec(deck);
      cspec = Setup::comm_spec(deck);
    } else {
      collective(MPI_COMM_WORLD, "command line", [&] {
        KOKKOSMOE_REQUIRE(layout != "hwloc" || (ranks_per_node == 0 && node_of_rank.empty()),
                          "--ranks-per-node and --node-of-rank declare nodes of a virtual or synthetic layout; "
                          "--layout hwloc takes the nodes from the machine");
      });
      spec.kind = from_string<Topology::LayoutKind>(layout);
      spec.ranks_per_node = ranks_per_node;
      spec.node_of_rank = node_of_rank;
      spec.synthetic = synthetic;
      spec.xml_file = xml;
      if (spec.kind != Topology::LayoutKind::hwloc && ranks_per_node == 0 && node_of_rank.empty())
        spec.ranks_per_node = comm_size(MPI_COMM_WORLD);
      cspec.peer_order = peer_order;
      cspec.relays_per_node = relays;
      cspec.relay_policy = from_string<Topology::RelayPolicy>(relay_policy);
    }
    auto topo = Topology::Topology::discover(MPI_COMM_WORLD, spec);
    Topology::CommunicatorSet comms(MPI_COMM_WORLD, topo, cspec);
    collective(MPI_COMM_WORLD, "writing the topology", [&] {
      if (rank != 0) return;
      auto const& hw = topo.node_hardware(0);
      std::cout << to_string(topo.kind()) << " layout: " << topo.size() << " ranks on " << topo.num_nodes()
                << " node(s); node 0: " << hw.packages << " package(s), " << hw.numa_nodes << " NUMA node(s), " << hw.cores
                << " cores, " << hw.pus << " PUs, " << hw.gpus.size() << " GPU(s), " << hw.nics.size() << " NIC(s) ["
                << hw.source << "]; " << comms.layout().relays_per_node << " relay(s) per node, communicator epoch "
                << comms.epoch() << "\n"
                << comms.table() << std::flush;
      if (!json_path.empty()) {
        write_text_file(json_path, comms.to_json(2) + "\n");
        std::cout << "json: " << json_path << "\n";
      }
      if (!export_path.empty()) {
        Topology::export_hwloc_xml(spec, export_path);
        std::cout << "hwloc xml: " << export_path << "\n";
      }
    });
    return 0;
  });
}
