#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Migration.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>

namespace KokkosMoE {

namespace {

std::size_t idx(MigrationAction a) { return static_cast<std::size_t>(a); }

// rank -> node from both placements' slots; -1 for a rank without slots.
std::vector<int> nodes_of_ranks(Placement const& source, Placement const& target) {
  std::vector<int> node(static_cast<std::size_t>(source.num_ranks()), -1);
  for (Placement const* p : {&source, &target}) {
    char const* which = p == &source ? "source" : "target";
    for (int s = 0; s < p->num_slots(); ++s) {
      auto const& sl = p->slot(s);
      KOKKOSMOE_REQUIRE(sl.node >= 0, "migration plan: " << which << " slot " << s << " (rank " << sl.rank
                                                         << ") has no node; build the placement with a rank -> node map");
      int& n = node[static_cast<std::size_t>(sl.rank)];
      KOKKOSMOE_REQUIRE(n < 0 || n == sl.node, "migration plan: rank " << sl.rank << " is on node " << n << " in one slot and on node "
                                                                    << sl.node << " in " << which << " slot " << s);
      n = sl.node;
    }
  }
  return node;
}

}  // namespace

MigrationPlan plan_migration(Placement const& source, Placement const& target, std::int64_t bytes_per_expert) {
  KOKKOSMOE_REQUIRE(bytes_per_expert >= 0, "migration plan: bytes per expert " << bytes_per_expert << " < 0");
  return plan_migration(source, target,
                        std::vector<std::int64_t>(static_cast<std::size_t>(source.num_experts()), bytes_per_expert));
}

MigrationPlan plan_migration(Placement const& source, Placement const& target,
                             std::vector<std::int64_t> const& bytes_of_expert) {
  KOKKOSMOE_REQUIRE(source.num_experts() == target.num_experts(), "migration plan: source has "
                                                                      << source.num_experts() << " experts, target has "
                                                                      << target.num_experts());
  KOKKOSMOE_REQUIRE(source.num_ranks() == target.num_ranks(),
                    "migration plan: source spans " << source.num_ranks() << " ranks, target " << target.num_ranks());
  int const E = source.num_experts(), R = source.num_ranks();
  KOKKOSMOE_REQUIRE(static_cast<int>(bytes_of_expert.size()) == E,
                    "migration plan: " << bytes_of_expert.size() << " byte sizes for " << E << " experts");
  // Byte totals sum over every slot of both placements: bound each size so
  // that no total overflows.
  std::int64_t const most = std::numeric_limits<std::int64_t>::max() / (std::int64_t(source.num_slots()) + target.num_slots() + 1);
  for (int e = 0; e < E; ++e)
    KOKKOSMOE_REQUIRE(bytes_of_expert[e] >= 0 && bytes_of_expert[e] <= most,
                      "migration plan: expert " << e << " has " << bytes_of_expert[e] << " bytes; sizes must be in [0, " << most
                                                << "] so that the byte totals of " << source.num_slots() << " + "
                                                << target.num_slots() << " slots cannot overflow");
  std::vector<int> const node = nodes_of_ranks(source, target);

  MigrationPlan plan;
  plan.source_generation = source.generation();
  plan.target_generation = target.generation();
  plan.num_experts = E;
  plan.num_ranks = R;
  plan.source_slots = source.num_slots();
  plan.target_slots = target.num_slots();
  plan.bytes_of_expert = bytes_of_expert;
  int const T = target.num_slots();
  plan.steps.resize(static_cast<std::size_t>(T));
  std::vector<char> claimed(static_cast<std::size_t>(source.num_slots()), 0);
  std::vector<char> decided(static_cast<std::size_t>(T), 0);
  auto set_step = [&](int t, MigrationAction a, int src) {
    auto const& ts = target.slot(t);
    auto const& ss = source.slot(src);
    MigrationStep& st = plan.steps[static_cast<std::size_t>(t)];
    st.target_slot = t;
    st.expert = ts.expert;
    st.target_rank = ts.rank;
    st.target_node = ts.node;
    st.action = a;
    st.source_slot = src;
    st.source_rank = ss.rank;
    st.source_node = ss.node;
    st.bytes = bytes_of_expert[static_cast<std::size_t>(ts.expert)];
    decided[static_cast<std::size_t>(t)] = 1;
  };
  // Pass 1: retain in the slot with the same id.
  for (int t = 0; t < T; ++t) {
    auto const& ts = target.slot(t);
    if (t < source.num_slots() && source.slot(t).rank == ts.rank && source.slot(t).expert == ts.expert) {
      claimed[static_cast<std::size_t>(t)] = 1;
      set_step(t, MigrationAction::retain, t);
    }
  }
  // Pass 2: retain in the lowest unclaimed slot of the same rank holding the
  // expert. Source slots sorted by (rank, expert, slot) with one cursor per
  // (rank, expert) run: O(S log S) however many slots a rank has.
  {
    struct Key {
      int rank, expert, slot;
      bool operator<(Key const& o) const {
        return rank != o.rank ? rank < o.rank : expert != o.expert ? expert < o.expert : slot < o.slot;
      }
    };
    std::vector<Key> keys;
    keys.reserve(static_cast<std::size_t>(source.num_slots()));
    for (int s = 0; s < source.num_slots(); ++s) keys.push_back(Key{source.slot(s).rank, source.slot(s).expert, s});
    std::sort(keys.begin(), keys.end());
    std::vector<std::size_t> cursor(keys.size());  // at the first key of a run: its next candidate
    for (std::size_t i = 0; i < keys.size(); ++i) cursor[i] = i;
    for (int t = 0; t < T; ++t) {
      if (decided[static_cast<std::size_t>(t)]) continue;
      auto const& ts = target.slot(t);
      Key const lo{ts.rank, ts.expert, -1};
      auto const first = static_cast<std::size_t>(std::lower_bound(keys.begin(), keys.end(), lo) - keys.begin());
      if (first == keys.size()) continue;
      auto& c = cursor[first];
      while (c < keys.size() && keys[c].rank == ts.rank && keys[c].expert == ts.expert && claimed[static_cast<std::size_t>(keys[c].slot)]) ++c;
      if (c < keys.size() && keys[c].rank == ts.rank && keys[c].expert == ts.expert) {
        claimed[static_cast<std::size_t>(keys[c].slot)] = 1;
        set_step(t, MigrationAction::retain, keys[c].slot);
        ++c;
      }
    }
  }
  // Pass 3: copies, preferring the same rank, then the same node, then the lowest slot.
  for (int t = 0; t < T; ++t) {
    if (decided[static_cast<std::size_t>(t)]) continue;
    auto const& ts = target.slot(t);
    int best = -1, best_class = 3;
    for (int j = 0; j < source.logcnt()[static_cast<std::size_t>(ts.expert)]; ++j) {
      int const s = source.log2phy()[static_cast<std::size_t>(ts.expert)][static_cast<std::size_t>(j)];
      auto const& ss = source.slot(s);
      int const cls = ss.rank == ts.rank ? 0 : (node[static_cast<std::size_t>(ss.rank)] == ts.node ? 1 : 2);
      if (cls < best_class || (cls == best_class && s < best)) {
        best = s;
        best_class = cls;
      }
    }
    set_step(t, best_class == 0 ? MigrationAction::same_rank_duplicate
                                : (best_class == 1 ? MigrationAction::same_node_copy : MigrationAction::cross_node_copy),
             best);
  }

  plan.source_resident_bytes.assign(static_cast<std::size_t>(R), 0);
  plan.target_resident_bytes.assign(static_cast<std::size_t>(R), 0);
  plan.peak_resident_bytes.assign(static_cast<std::size_t>(R), 0);
  for (int s = 0; s < source.num_slots(); ++s)
    plan.source_resident_bytes[static_cast<std::size_t>(source.slot(s).rank)] +=
        bytes_of_expert[static_cast<std::size_t>(source.slot(s).expert)];
  plan.peak_resident_bytes = plan.source_resident_bytes;
  for (auto const& st : plan.steps) {
    plan.totals.bytes[idx(st.action)] += st.bytes;
    plan.totals.count[idx(st.action)] += 1;
    plan.target_resident_bytes[static_cast<std::size_t>(st.target_rank)] += st.bytes;
    if (st.action != MigrationAction::retain) plan.peak_resident_bytes[static_cast<std::size_t>(st.target_rank)] += st.bytes;
  }
  for (auto v : plan.peak_resident_bytes) {
    plan.peak_resident_bytes_max = std::max(plan.peak_resident_bytes_max, v);
    plan.peak_resident_bytes_total += v;
  }
  return plan;
}

MigrationBytes MigrationPlan::sent_by(int rank) const {
  MigrationBytes b;
  for (auto const& st : steps) {
    if (st.action == MigrationAction::retain || st.source_rank != rank) continue;
    b.bytes[idx(st.action)] += st.bytes;
    b.count[idx(st.action)] += 1;
  }
  return b;
}

MigrationBytes MigrationPlan::received_by(int rank) const {
  MigrationBytes b;
  for (auto const& st : steps) {
    if (st.target_rank != rank) continue;
    b.bytes[idx(st.action)] += st.bytes;
    b.count[idx(st.action)] += 1;
  }
  return b;
}

std::uint64_t MigrationPlan::fingerprint() const {
  std::vector<std::int64_t> w = {static_cast<std::int64_t>(source_generation), static_cast<std::int64_t>(target_generation),
                                  num_experts, num_ranks, source_slots, target_slots};
  w.insert(w.end(), bytes_of_expert.begin(), bytes_of_expert.end());
  for (auto const& st : steps) {
    for (std::int64_t v : {std::int64_t(st.target_slot), std::int64_t(st.expert), std::int64_t(st.target_rank),
                           std::int64_t(st.action), std::int64_t(st.source_slot), std::int64_t(st.source_rank), st.bytes})
      w.push_back(v);
  }
  return digest_bytes(w.data(), w.size() * sizeof(std::int64_t));
}

namespace {

struct DupComm {
  MPI_Comm comm = MPI_COMM_NULL;
  explicit DupComm(MPI_Comm parent) {
    KOKKOSMOE_MPI_CHECK(MPI_Comm_dup(parent, &comm), parent);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_set_name(comm, "KokkosMoE::Migration");
  }
  ~DupComm() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  DupComm(DupComm const&) = delete;
  DupComm& operator=(DupComm const&) = delete;
};

bool moves_between_ranks(MigrationAction a) {
  return a == MigrationAction::same_node_copy || a == MigrationAction::cross_node_copy;
}

}  // namespace

MigrationLedger execute_migration(MPI_Comm comm, MigrationPlan const& plan, Placement const& source,
                                  Placement const& target, std::vector<ParameterBlob> const& source_blobs,
                                  std::vector<ParameterBlob>& target_blobs, MigrationOptions const& options) {
  int const me = comm_rank(comm);
  int const size = comm_size(comm);

  // Every rank must hold the same plan before any payload moves.
  std::uint64_t const fp = plan.fingerprint();
  std::uint64_t mine[2] = {fp, ~fp}, agreed[2] = {0, 0};
  KOKKOSMOE_MPI_CHECK(MPI_Allreduce(mine, agreed, 2, MPI_UINT64_T, MPI_MAX, comm), comm);
  bool const same_plan = agreed[0] == fp && agreed[1] == ~fp;

  collective(comm, "migration validation", [&] {
    KOKKOSMOE_REQUIRE(same_plan, "the ranks hold different migration plans (fingerprint " << digest_hex(fp) << " on rank "
                                                                                         << me << ")");
    KOKKOSMOE_REQUIRE(size == plan.num_ranks, "migration over " << size << " ranks for a plan of " << plan.num_ranks << " ranks");
    KOKKOSMOE_REQUIRE(plan.num_experts == source.num_experts() && plan.num_ranks == source.num_ranks() &&
                          plan.source_slots == source.num_slots() && plan.target_slots == target.num_slots() &&
                          plan.source_generation == source.generation() && plan.target_generation == target.generation() &&
                          target.num_experts() == source.num_experts() && target.num_ranks() == source.num_ranks(),
                      "the migration plan (generations " << plan.source_generation << " -> " << plan.target_generation << ", "
                                                         << plan.source_slots << " -> " << plan.target_slots
                                                         << " slots) does not belong to these placements (generations "
                                                         << source.generation() << " -> " << target.generation() << ", "
                                                         << source.num_slots() << " -> " << target.num_slots() << " slots)");
    KOKKOSMOE_REQUIRE(options.max_message_bytes > 0, "max_message_bytes " << options.max_message_bytes << " must be positive");
    auto const& local_src = source.slots_of_rank(me);
    KOKKOSMOE_REQUIRE(source_blobs.size() == local_src.size(), "rank " << me << " passes " << source_blobs.size()
                                                                       << " source blobs for its " << local_src.size()
                                                                       << " source slots");
    for (std::size_t i = 0; i < local_src.size(); ++i) {
      int const s = local_src[i];
      auto const& sl = source.slot(s);
      std::int64_t const want = plan.bytes_of_expert[static_cast<std::size_t>(sl.expert)];
      KOKKOSMOE_REQUIRE(static_cast<std::int64_t>(source_blobs[i].size()) == want,
                        "source slot " << s << " (expert " << sl.expert << ", rank " << me << ") has "
                                       << source_blobs[i].size() << " bytes, the plan says " << want);
      if (options.verify_sources) {
        std::uint64_t const d = digest_bytes(source_blobs[i].data(), source_blobs[i].size());
        KOKKOSMOE_REQUIRE(d == sl.digest, "source slot " << s << " (expert " << sl.expert << ", rank " << me
                                                         << ") has digest " << digest_hex(d) << " but the source placement says "
                                                         << digest_hex(sl.digest));
      }
    }
    for (int t : target.slots_of_rank(me)) {
      auto const& st = plan.steps[static_cast<std::size_t>(t)];
      KOKKOSMOE_REQUIRE(target.slot(t).digest == source.slot(st.source_slot).digest,
                        "target slot " << t << " (expert " << st.expert << ", rank " << me << ") expects digest "
                                       << digest_hex(target.slot(t).digest) << " but its source slot " << st.source_slot
                                       << " has digest " << digest_hex(source.slot(st.source_slot).digest));
    }
  });

  MigrationLedger ledger;
  auto const& local_tgt = target.slots_of_rank(me);
  target_blobs.assign(local_tgt.size(), ParameterBlob());
  DupComm dup(comm);
  std::vector<MPI_Request> requests;
  std::vector<MigrationAction> recv_action;  // per receive request, its class
  std::vector<std::size_t> recv_request_index;
  int const tag = 0;
  collective(comm, "migration transfer", [&] {
    std::int64_t const chunk = options.max_message_bytes;
    // Receives first, then sends, both in target-slot order: messages between a
    // pair of ranks match in posting order (one tag, non-overtaking).
    for (auto const& st : plan.steps) {
      if (st.target_rank != me || !moves_between_ranks(st.action)) continue;
      auto& blob = target_blobs[static_cast<std::size_t>(target.local_index(st.target_slot))];
      blob.resize(static_cast<std::size_t>(st.bytes));
      for (std::int64_t off = 0; off < st.bytes; off += chunk) {
        int const n = static_cast<int>(std::min(chunk, st.bytes - off));
        requests.emplace_back();
        KOKKOSMOE_MPI_CHECK(MPI_Irecv(blob.data() + off, n, MPI_BYTE, st.source_rank, tag, dup.comm, &requests.back()),
                            dup.comm);
        recv_request_index.push_back(requests.size() - 1);
        recv_action.push_back(st.action);
        ++ledger.messages_received;
      }
    }
    for (auto const& st : plan.steps) {
      if (st.source_rank != me || !moves_between_ranks(st.action)) continue;
      auto const& blob = source_blobs[static_cast<std::size_t>(source.local_index(st.source_slot))];
      for (std::int64_t off = 0; off < st.bytes; off += chunk) {
        int const n = static_cast<int>(std::min(chunk, st.bytes - off));
        requests.emplace_back();
        KOKKOSMOE_MPI_CHECK(MPI_Isend(blob.data() + off, n, MPI_BYTE, st.target_rank, tag, dup.comm, &requests.back()),
                            dup.comm);
        ledger.sent.bytes[idx(st.action)] += n;
        ++ledger.messages_sent;
      }
      ledger.sent.count[idx(st.action)] += 1;
    }
    // Local actions overlap with the messages in flight.
    for (int t : local_tgt) {
      auto const& st = plan.steps[static_cast<std::size_t>(t)];
      if (moves_between_ranks(st.action)) continue;
      auto const& src = source_blobs[static_cast<std::size_t>(source.local_index(st.source_slot))];
      target_blobs[static_cast<std::size_t>(target.local_index(t))] = src;
      if (st.action == MigrationAction::same_rank_duplicate) {
        ledger.sent.bytes[idx(st.action)] += static_cast<std::int64_t>(src.size());
        ledger.sent.count[idx(st.action)] += 1;
      }
      ledger.received.bytes[idx(st.action)] += static_cast<std::int64_t>(src.size());
      ledger.received.count[idx(st.action)] += 1;
    }
    std::vector<MPI_Status> statuses(requests.size());
    if (!requests.empty())
      KOKKOSMOE_MPI_CHECK(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), statuses.data()), dup.comm);
    for (std::size_t i = 0; i < recv_request_index.size(); ++i) {
      int got = 0;
      KOKKOSMOE_MPI_CHECK(MPI_Get_count(&statuses[recv_request_index[i]], MPI_BYTE, &got), dup.comm);
      ledger.received.bytes[idx(recv_action[i])] += got;
    }
    for (auto const& st : plan.steps)
      if (st.target_rank == me && moves_between_ranks(st.action)) ledger.received.count[idx(st.action)] += 1;
  });

  // Verify every local target blob against its source slot's digest.
  ledger.target_digests.resize(local_tgt.size());
  collective(comm, "migration digest verification", [&] {
    std::ostringstream bad;
    int mismatches = 0;
    for (std::size_t i = 0; i < local_tgt.size(); ++i) {
      int const t = local_tgt[i];
      auto const& st = plan.steps[static_cast<std::size_t>(t)];
      std::uint64_t const d = digest_bytes(target_blobs[i].data(), target_blobs[i].size());
      ledger.target_digests[i] = d;
      std::uint64_t const want = source.slot(st.source_slot).digest;
      if (d == want) continue;
      if (mismatches < 8)
        bad << (mismatches ? "; " : "") << "target slot " << t << " (expert " << st.expert << ", " << to_string(st.action)
            << " from slot " << st.source_slot << " on rank " << st.source_rank << ") has digest " << digest_hex(d)
            << ", expected " << digest_hex(want);
      ++mismatches;
    }
    KOKKOSMOE_REQUIRE(mismatches == 0, "rank " << me << ": " << mismatches << " received slot" << (mismatches == 1 ? "" : "s")
                                              << " failed digest verification: " << bad.str()
                                              << (mismatches > 8 ? "; ..." : ""));
  });

  KOKKOSMOE_MPI_CHECK(MPI_Allreduce(ledger.sent.bytes.data(), ledger.sent_total.bytes.data(), kNumMigrationActions,
                                    MPI_INT64_T, MPI_SUM, comm),
                      comm);
  KOKKOSMOE_MPI_CHECK(MPI_Allreduce(ledger.sent.count.data(), ledger.sent_total.count.data(), kNumMigrationActions,
                                    MPI_INT64_T, MPI_SUM, comm),
                      comm);
  return ledger;
}

std::vector<std::uint64_t> gather_slot_digests(MPI_Comm comm, Placement const& placement,
                                               std::vector<std::uint64_t> const& local_digests) {
  int const me = comm_rank(comm);
  int const size = comm_size(comm);
  collective(comm, "gather_slot_digests", [&] {
    KOKKOSMOE_REQUIRE(size == placement.num_ranks(),
                      "gather_slot_digests over " << size << " ranks for a placement of " << placement.num_ranks() << " ranks");
    KOKKOSMOE_REQUIRE(static_cast<int>(local_digests.size()) == placement.num_slots_of_rank(me),
                      "rank " << me << " passes " << local_digests.size() << " digests for its "
                              << placement.num_slots_of_rank(me) << " slots");
  });
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size), 0);
  for (int r = 0; r < size; ++r) counts[r] = placement.num_slots_of_rank(r);
  for (int r = 1; r < size; ++r) displs[r] = displs[r - 1] + counts[r - 1];
  std::vector<std::uint64_t> all(static_cast<std::size_t>(placement.num_slots()));
  KOKKOSMOE_MPI_CHECK(MPI_Allgatherv(local_digests.data(), counts[static_cast<std::size_t>(me)], MPI_UINT64_T, all.data(),
                                     counts.data(), displs.data(), MPI_UINT64_T, comm),
                      comm);
  std::vector<std::uint64_t> out(all.size());
  for (int r = 0; r < size; ++r) {
    auto const& sl = placement.slots_of_rank(r);
    for (std::size_t i = 0; i < sl.size(); ++i) out[static_cast<std::size_t>(sl[i])] = all[static_cast<std::size_t>(displs[r]) + i];
  }
  return out;
}

}  // namespace KokkosMoE
