// kmoe-layer, [run] mode = "train": every step a forward of the student
// (the deck's layer), the mean squared error against a teacher layer of the
// same shape (experts from [train] teacher_seed; its router the student's
// initial one unless teacher_router = "own"), the backward and an optimizer
// step. The report's "train" object holds the loss, gradient norm and
// balance loss per step and the backward's stage seconds.

#include "kmoe_layer_train.hpp"

#include "kmoe_app.hpp"
#include "kmoe_layer_output.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_LayerSetup.hpp>
#include <KokkosMoE_Migration.hpp>
#include <KokkosMoE_Report.hpp>
#include <KokkosMoE_Train.hpp>
#include <KokkosMoE_Version.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <map>

namespace kmoe_layer {
namespace {

using namespace KokkosMoE;

/// Digest of trained weights: the router weight, the shared experts and
/// every routed expert by logical id (its first copy), the same on every
/// rank, and the same for any number of ranks that trained the same weights.
std::string trained_weights_digest(MoELayer<float, Exec, MS>& layer, RowMatrix<float, MS> const& router, MPI_Comm comm) {
  auto& routed = layer.routed_weights();
  routed.refresh_digests();
  auto const all = gather_slot_digests(comm, layer.placement(), routed.digests());
  std::vector<std::uint64_t> parts;
  auto const hr = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), router);
  parts.push_back(digest_bytes(hr.data(), hr.size() * sizeof(float)));
  if (auto* shared = layer.shared_weights()) {
    shared->refresh_digests();
    for (auto d : shared->digests()) parts.push_back(d);
  }
  auto const& placement = layer.placement();
  std::vector<std::uint64_t> by_expert(static_cast<std::size_t>(placement.num_experts()), 0);
  std::vector<bool> seen(by_expert.size(), false);
  for (int s = 0; s < placement.num_slots(); ++s) {
    auto const e = static_cast<std::size_t>(placement.slot(s).expert);
    if (!seen[e]) by_expert[e] = all[static_cast<std::size_t>(s)], seen[e] = true;
  }
  parts.insert(parts.end(), by_expert.begin(), by_expert.end());
  return digest_hex(digest_bytes(parts.data(), parts.size() * sizeof(std::uint64_t)));
}

/// [run] mode = "train": the student (the deck's layer) against a teacher.
}  // namespace

int train(LayerDeck const& deck, TrainOptions const& opt) {
  MPI_Comm const world = MPI_COMM_WORLD;
  int const rank = comm_rank(world), size = comm_size(world);
  Exec exec;
  Setup::Run setup = Setup::make_run(deck, world);
  LayerDeck teacher_deck = deck;
  teacher_deck.run.seed = deck.train.teacher_seed != 0 ? deck.train.teacher_seed : deck.run.seed + 1;
  teacher_deck.experts.weights.clear();  // the teacher's own random weights
  auto student_router = Setup::router_weight<float, MS>(deck);
  MoELayer<float, Exec, MS> student(setup.config, *setup.comms, setup.placement, student_router,
                                    Setup::routed_weights<float, MS>(exec, deck, setup, rank, world), Setup::shared_weights<float, MS>(exec, deck));
  // The teacher routes like the untrained student (a copy of its router
  // weight) unless [train] teacher_router = "own": its experts are its own.
  RowMatrix<float, MS> teacher_router("kmoe-layer::teacher_router", student_router.extent(0), student_router.extent(1));
  Kokkos::deep_copy(teacher_router, deck.train.teacher_router == "own" ? Setup::router_weight<float, MS>(teacher_deck) : student_router);
  MoELayer<float, Exec, MS> teacher(setup.config, *setup.comms, setup.placement, teacher_router,
                                    Setup::routed_weights<float, MS>(exec, teacher_deck, setup, rank, world),
                                    Setup::shared_weights<float, MS>(exec, teacher_deck));
  TrainConfig tc;
  tc.optimizer = deck.train.optimizer;
  tc.learning_rate = deck.train.learning_rate;
  tc.schedule = deck.train.schedule;
  tc.gradient_block = deck.train.gradient_block;
  tc.reproducible_shared = deck.train.reproducible_shared;
  tc.total_steps = opt.steps >= 0 ? opt.steps : deck.run.steps;
  if (deck.train.balance_alpha > 0) {
    tc.balance = BalanceLossConfig{};
    tc.balance->alpha = deck.train.balance_alpha;
  }
  Trainer<Exec, MS> trainer(student, teacher, student_router, tc);
  int const steps = opt.steps >= 0 ? opt.steps : deck.run.steps;
  index_t const tokens = Setup::tokens_per_rank(deck), first = Setup::first_token(deck, rank);
  double const watchdog = deck.exchange.watchdog_seconds;
  if (rank == 0)
    std::cout << "train: " << size << " rank(s), " << tokens << " tokens per rank, " << steps << " steps, " << tc.optimizer
              << " learning rate " << tc.learning_rate << ", teacher seed " << teacher_deck.run.seed << " (router: "
              << (deck.train.teacher_router == "own" ? "its own" : "the student's initial") << ")"
              << (tc.balance ? ", balance loss alpha " + std::to_string(tc.balance->alpha) : std::string()) << "\n";
  std::vector<double> loss, norm, balance, forward_s;
  std::map<std::string, double> backward_s;
  std::string experts_backward;  // the routed experts' backward path (this rank's last step)
  StepSeries series;  // the HDF5 time series ([run] hdf5 / --hdf5)
  int const every = std::max(1, steps / 10);
  Kokkos::Timer timer;
  RowMatrix<float, MS> hidden;  // one matrix for every step's rows
  for (int step = 0; step < steps; ++step) {
    kmoe_app::fault_point(rank, step);
    if (step == 0)
      hidden = Setup::hidden_rows<float, MS>(deck, step, first, tokens, rank);
    else
      Setup::hidden_rows_into(deck, step, first, hidden, rank);
    TrainStepRecord const r = trainer.step(exec, hidden);
    loss.push_back(r.loss);
    norm.push_back(r.grad_norm);
    balance.push_back(r.balance_loss);
    forward_s.push_back(r.forward_seconds);
    if (!r.backward.experts.path.empty()) experts_backward = r.backward.experts.path;
    series.add("loss", r.loss);
    series.add("grad_norm", r.grad_norm);
    series.add("balance_loss", r.balance_loss);
    series.add("forward_s", r.forward_seconds);
    for (auto const& [k, v] : kmoe_app::slowest(r.backward.seconds, world, watchdog)) {
      backward_s[k] += v / std::max(1, steps);
      series.add("backward_" + k + "_s", v);
    }
    if (rank == 0 && ((step + 1) % every == 0 || step == 0)) {
      std::printf("train: step %d/%d loss %.6g grad_norm %.4g%s (%.1f s)\n", step + 1, steps, r.loss, r.grad_norm,
                  tc.balance ? (" balance " + std::to_string(r.balance_loss)).c_str() : "", timer.seconds());
      std::fflush(stdout);
    }
  }
  std::string const weights_digest = trained_weights_digest(student, student_router, world);
  double const first_loss = loss.empty() ? 0.0 : loss.front(), last_loss = loss.empty() ? 0.0 : loss.back();
  double const ratio = first_loss > 0 ? last_loss / first_loss : 0.0;
  json report;
  report["build"] = build_summary();
  report["deck"] = deck.path;
  report["resolved_deck"] = deck.resolved();
  report["mode"] = "train";
  report["ranks"] = size;
  report["tokens_per_rank"] = tokens;
  report["steps"] = steps;
  report["train"] = {{"optimizer", tc.optimizer},
                     {"learning_rate", tc.learning_rate},
                     {"schedule", tc.schedule},
                     {"teacher_seed", teacher_deck.run.seed},
                     {"teacher_router", deck.train.teacher_router},
                     {"loss", loss},
                     {"grad_norm", norm},
                     {"balance_loss", balance},
                     {"forward_seconds", forward_s},
                     {"backward_seconds_mean", backward_s},
                     {"loss_ratio", ratio},
                     {"products", deck.train.products},
                     {"experts_backward_path", experts_backward},
                     {"weights_digest", weights_digest}};
  write_outputs(world, watchdog, deck.path, report, opt.report.empty() ? deck.run.report : opt.report, &series,
                opt.hdf5.empty() ? deck.run.hdf5 : opt.hdf5, {{"mode", "train"}});
  if (rank == 0) {
    std::printf("TRAIN steps=%d ranks=%d optimizer=%s loss_first=%.6g loss_last=%.6g loss_ratio=%.4f backward_s=%.4g weights_digest=%s "
                "experts_backward=%s\n",
                steps, size, tc.optimizer.c_str(), first_loss, last_loss, ratio, backward_s.count("total") ? backward_s.at("total") : 0.0,
                weights_digest.c_str(), experts_backward.empty() ? "none" : experts_backward.c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace kmoe_layer
