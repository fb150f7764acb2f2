// Migration plans (one action per target slot, source preference, bytes,
// peak resident bytes) and their execution over MPI: parameters move,
// digests verify on the receiving ranks, the byte ledger matches the plan,
// and corrupted or inconsistent inputs raise the same error on every rank.
// Virtual nodes: two consecutive ranks per node ({0,1},{2,3} at 4 ranks).

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Collective.hpp>
#include <KokkosMoE_Digest.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Migration.hpp>
#include <KokkosMoE_PlacementRegistry.hpp>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

using namespace KokkosMoE;

namespace {

std::size_t a(MigrationAction x) { return static_cast<std::size_t>(x); }

int ranks_per_node(int size) { return size >= 2 ? 2 : 1; }

std::vector<int> node_map(int size) {
  std::vector<int> n(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) n[r] = r / ranks_per_node(size);
  return n;
}

std::vector<std::int64_t> expert_bytes(int E) {
  std::vector<std::int64_t> b(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) b[e] = 1000 + 37 * e;  // not multiples of anything useful
  return b;
}

ParameterBlob expert_blob(int e, std::int64_t bytes) {
  ParameterBlob b(static_cast<std::size_t>(bytes));
  std::uint32_t x = 2654435761u * static_cast<std::uint32_t>(e + 1);
  for (auto& c : b) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<unsigned char>(x >> 24);
  }
  return b;
}

std::vector<std::uint64_t> expert_digests(int E) {
  auto const bytes = expert_bytes(E);
  std::vector<std::uint64_t> d;
  for (int e = 0; e < E; ++e) {
    auto const b = expert_blob(e, bytes[e]);
    d.push_back(digest_bytes(b.data(), b.size()));
  }
  return d;
}

std::vector<ParameterBlob> local_source_blobs(Placement const& source, int me) {
  auto const bytes = expert_bytes(source.num_experts());
  std::vector<ParameterBlob> blobs;
  for (int s : source.slots_of_rank(me)) blobs.push_back(expert_blob(source.slot(s).expert, bytes[source.slot(s).expert]));
  return blobs;
}

// Contiguous source: rank r holds experts 2r and 2r+1 (slots 2r, 2r+1).
Placement source_placement(int size) {
  int const E = 2 * size;
  return Placement::contiguous(E, size, node_map(size)).with_expert_digests(expert_digests(E), 1).with_generation(1);
}

// Explicit target, 3 slots per rank: rank r holds [2r+1, 2r+1, 2((r+1) % R)]:
// a retain, a same-rank duplicate and a copy from the next rank.
Placement explicit_target(int size) {
  int const E = 2 * size;
  std::vector<SlotInfo> slots;
  for (int r = 0; r < size; ++r)
    for (int e : {2 * r + 1, 2 * r + 1, 2 * ((r + 1) % size)}) {
      SlotInfo s;
      s.expert = e;
      s.rank = r;
      slots.push_back(s);
    }
  return Placement(E, size, slots, node_map(size), 2).with_expert_digests(expert_digests(E), 1);
}

// EPLB target for loads growing with the expert id (the hot group was on the
// last node and moves to node 0).
Placement eplb_target(int size) {
  int const E = 2 * size;
  std::vector<double> load(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) load[e] = 1 + e * e;
  PlacementSpec spec;
  spec.physical_slots = 3 * size;
  spec.nodes = size / ranks_per_node(size);
  spec.groups = 2 * spec.nodes;
  spec.ranks = size;
  spec.generation = 3;
  auto const lp = eplb_layer(load, spec);
  return lp.placement.with_expert_digests(expert_digests(E), 1);
}

// Invariants of any plan.
void check_plan(MigrationPlan const& plan, Placement const& source, Placement const& target) {
  REQUIRE(static_cast<int>(plan.steps.size()) == target.num_slots());
  std::vector<int> retained(static_cast<std::size_t>(source.num_slots()), 0);
  for (int t = 0; t < target.num_slots(); ++t) {
    auto const& st = plan.steps[t];
    CHECK(st.target_slot == t);
    CHECK(st.expert == target.slot(t).expert);
    CHECK(st.target_rank == target.slot(t).rank);
    REQUIRE(st.source_slot >= 0);
    CHECK(source.slot(st.source_slot).expert == st.expert);  // the source stores that expert
    CHECK(st.source_rank == source.slot(st.source_slot).rank);
    CHECK(st.bytes == plan.bytes_of_expert[st.expert]);
    // Which copies of the expert exist on the target rank / node in the source?
    bool on_rank = false, on_node = false;
    for (int j = 0; j < source.logcnt()[st.expert]; ++j) {
      auto const& ss = source.slot(source.log2phy()[st.expert][j]);
      on_rank |= ss.rank == st.target_rank;
      on_node |= ss.node == st.target_node;
    }
    switch (st.action) {
      case MigrationAction::retain:
        CHECK(st.source_rank == st.target_rank);
        ++retained[st.source_slot];
        break;
      case MigrationAction::same_rank_duplicate: CHECK(st.source_rank == st.target_rank); break;
      case MigrationAction::same_node_copy:
        CHECK_FALSE(on_rank);
        CHECK(st.source_rank != st.target_rank);
        CHECK(st.source_node == st.target_node);
        break;
      case MigrationAction::cross_node_copy:
        CHECK_FALSE(on_rank);
        CHECK_FALSE(on_node);
        CHECK(st.source_node != st.target_node);
        break;
    }
  }
  for (int s = 0; s < source.num_slots(); ++s) CHECK(retained[s] <= 1);
  // A duplicate only when every same-rank source slot of the expert is retained.
  for (auto const& st : plan.steps) {
    if (st.action != MigrationAction::same_rank_duplicate) continue;
    for (int s : source.slots_of_rank(st.target_rank))
      if (source.slot(s).expert == st.expert) CHECK(retained[s] == 1);
  }
  // Peak resident bytes: source slots + non-retained target slots, per rank.
  for (int r = 0; r < source.num_ranks(); ++r) {
    std::int64_t peak = 0, after = 0;
    for (int s : source.slots_of_rank(r)) peak += plan.bytes_of_expert[source.slot(s).expert];
    for (int t : target.slots_of_rank(r)) {
      after += plan.bytes_of_expert[target.slot(t).expert];
      if (plan.steps[t].action != MigrationAction::retain) peak += plan.bytes_of_expert[target.slot(t).expert];
    }
    CHECK(plan.peak_resident_bytes[r] == peak);
    CHECK(plan.target_resident_bytes[r] == after);
  }
}

// Runs the plan and checks content, digests and the ledger against the plan.
MigrationLedger run_and_check(MigrationPlan const& plan, Placement const& source, Placement const& target,
                              MigrationOptions const& options = {}) {
  int const me = kmoe_test::world_rank();
  std::vector<ParameterBlob> out;
  auto const ledger = execute_migration(MPI_COMM_WORLD, plan, source, target, local_source_blobs(source, me), out, options);
  auto const& mine = target.slots_of_rank(me);
  REQUIRE(out.size() == mine.size());
  auto const bytes = expert_bytes(target.num_experts());
  auto const digests = expert_digests(target.num_experts());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    int const e = target.slot(mine[i]).expert;
    CHECK(out[i] == expert_blob(e, bytes[e]));
    CHECK(ledger.target_digests[i] == digests[e]);
  }
  // The ledger equals the plan: per rank and in total, per action class.
  auto const sent = plan.sent_by(me);
  auto const received = plan.received_by(me);
  for (auto act : {MigrationAction::retain, MigrationAction::same_rank_duplicate, MigrationAction::same_node_copy,
                   MigrationAction::cross_node_copy}) {
    INFO("action " << to_string(act) << " rank " << me);
    CHECK(ledger.sent.bytes[a(act)] == sent.bytes[a(act)]);
    CHECK(ledger.sent.count[a(act)] == sent.count[a(act)]);
    CHECK(ledger.received.bytes[a(act)] == received.bytes[a(act)]);
    CHECK(ledger.received.count[a(act)] == received.count[a(act)]);
    if (act == MigrationAction::retain) {
      CHECK(ledger.sent_total.bytes[a(act)] == 0);  // nothing moves
    } else {
      CHECK(ledger.sent_total.bytes[a(act)] == plan.totals.bytes[a(act)]);
      CHECK(ledger.sent_total.count[a(act)] == plan.totals.count[a(act)]);
    }
  }
  // Same-rank actions are never messages.
  std::int64_t expected_messages = 0;
  for (auto const& st : plan.steps)
    if (st.source_rank == me && st.target_rank != me)
      expected_messages += (st.bytes + options.max_message_bytes - 1) / options.max_message_bytes;
  CHECK(ledger.messages_sent == expected_messages);
  return ledger;
}

}  // namespace

TEST_CASE("Migration plan: byte sizes that would overflow the totals are refused", "[placement][migration]") {
  Placement const a = Placement::contiguous(8, 2, {0, 1}), b = Placement::round_robin(8, 2, {0, 1});
  CHECK_NOTHROW(plan_migration(a, b, std::int64_t(1) << 40));
  CHECK_THROWS_WITH(plan_migration(a, b, std::int64_t(1) << 62), Catch::Matchers::Contains("cannot overflow"));
  CHECK_THROWS_WITH(plan_migration(a, b, -1), Catch::Matchers::Contains("< 0"));
}

TEST_CASE("Migration plan: many slots per rank (same-rank retention through sorted runs)", "[placement][migration]") {
  // 2 ranks, 40000 experts each with a copy; the target swaps which copy is
  // first: every target slot is retained on its rank, none is copied.
  int const E = 80000, R = 2;
  std::vector<SlotInfo> src, tgt;
  for (int e = 0; e < E; ++e) src.push_back(SlotInfo{e, e % R, -1, 0, 0});
  for (int e = E - 1; e >= 0; --e) tgt.push_back(SlotInfo{e, e % R, -1, 0, 0});
  Placement const a(E, R, src, {0, 0}), b(E, R, tgt, {0, 0});
  auto const plan = plan_migration(a, b, 16);
  std::int64_t retained = 0;
  for (auto const& st : plan.steps) {
    retained += st.action == MigrationAction::retain ? 1 : 0;
    CHECK(a.slot(st.source_slot).expert == st.expert);
  }
  CHECK(retained == E);
}

TEST_CASE("Migration plan: actions, source preference, bytes and peak", "[placement][migration]") {
  // 4 ranks on nodes {0,1},{2,3}; pure planning, identical on every rank.
  std::vector<SlotInfo> src;
  auto add = [](std::vector<SlotInfo>& v, int e, int r) {
    SlotInfo s;
    s.expert = e;
    s.rank = r;
    v.push_back(s);
  };
  add(src, 0, 1);  // s0
  add(src, 0, 3);  // s1
  add(src, 0, 2);  // s2
  add(src, 1, 0);  // s3
  add(src, 1, 2);  // s4
  add(src, 2, 3);  // s5
  add(src, 2, 2);  // s6
  std::vector<SlotInfo> tgt;
  add(tgt, 0, 0);  // t0: same node (s0 on rank 1)
  add(tgt, 0, 3);  // t1: retain s1
  add(tgt, 0, 3);  // t2: duplicate of s1
  add(tgt, 1, 1);  // t3: same node (s3 on rank 0)
  add(tgt, 2, 0);  // t4: cross node, lowest of s5/s6 -> s5
  add(tgt, 1, 3);  // t5: same node s4 (rank 2) preferred over the lower s3 (node 0)
  add(tgt, 0, 2);  // t6: retain s2
  std::vector<int> const nodes = {0, 0, 1, 1};
  Placement const source(3, 4, src, nodes, 1), target(3, 4, tgt, nodes, 2);
  auto const plan = plan_migration(source, target, 10);
  check_plan(plan, source, target);
  using M = MigrationAction;
  std::vector<M> const actions = {M::same_node_copy, M::retain,         M::same_rank_duplicate, M::same_node_copy,
                                  M::cross_node_copy, M::same_node_copy, M::retain};
  std::vector<int> const sources = {0, 1, 1, 3, 5, 4, 2};
  for (int t = 0; t < 7; ++t) {
    INFO("target slot " << t);
    CHECK(plan.steps[t].action == actions[t]);
    CHECK(plan.steps[t].source_slot == sources[t]);
  }
  CHECK(plan.totals.bytes[a(M::retain)] == 20);
  CHECK(plan.totals.bytes[a(M::same_rank_duplicate)] == 10);
  CHECK(plan.totals.bytes[a(M::same_node_copy)] == 30);
  CHECK(plan.totals.bytes[a(M::cross_node_copy)] == 10);
  CHECK(plan.source_resident_bytes == std::vector<std::int64_t>{10, 10, 30, 20});
  CHECK(plan.target_resident_bytes == std::vector<std::int64_t>{20, 10, 10, 30});
  CHECK(plan.peak_resident_bytes == std::vector<std::int64_t>{30, 20, 30, 40});
  CHECK(plan.peak_resident_bytes_max == 40);
  CHECK(plan.peak_resident_bytes_total == 120);
  CHECK(plan.sent_by(3).bytes[a(M::cross_node_copy)] == 10);
  CHECK(plan.received_by(0).count[a(M::same_node_copy)] == 1);

  // Retain prefers the slot with the same id: identical placements retain everything.
  auto const same = plan_migration(source, source, 10);
  for (int s = 0; s < source.num_slots(); ++s) {
    CHECK(same.steps[s].action == M::retain);
    CHECK(same.steps[s].source_slot == s);
  }
  CHECK(same.peak_resident_bytes == same.source_resident_bytes);

  // Errors.
  auto expect = [](auto f, std::string const& text) {
    std::string msg;
    try {
      f();
    } catch (Error const& e) {
      msg = e.what();
    }
    INFO(msg);
    CHECK(msg.find(text) != std::string::npos);
  };
  expect([&] { plan_migration(source, Placement::contiguous(4, 4, nodes), 10); }, "source has 3 experts, target has 4");
  expect([&] { plan_migration(source, Placement::contiguous(3, 3), 10); }, "source spans 4 ranks, target 3");
  expect([&] { plan_migration(source, Placement::contiguous(3, 4), 10); }, "has no node");
  expect([&] { plan_migration(source, target, std::vector<std::int64_t>{1, 2}); }, "2 byte sizes for 3 experts");
  expect([&] { plan_migration(source, Placement::contiguous(3, 4, {0, 1, 1, 1}), 10); }, "rank 1 is on node 0");
}

TEST_CASE("Migration over MPI: explicit target moves parameters and verifies digests", "[placement][migration][mpi]") {
  int const size = kmoe_test::world_size();
  auto const source = source_placement(size);
  auto const target = explicit_target(size);
  auto const plan = plan_migration(source, target, expert_bytes(source.num_experts()));
  check_plan(plan, source, target);
  using M = MigrationAction;
  // One rank: the "next rank's" expert 0 is its own, retained as well.
  CHECK(plan.totals.count[a(M::retain)] == (size == 1 ? 2 : size));
  CHECK(plan.totals.count[a(M::same_rank_duplicate)] == size);
  if (size == 4) {
    // Nodes {0,1},{2,3}: ranks 0 and 2 copy inside their node, 1 and 3 across.
    CHECK(plan.totals.count[a(M::same_node_copy)] == 2);
    CHECK(plan.totals.count[a(M::cross_node_copy)] == 2);
    CHECK(plan.steps[2].action == M::same_node_copy);   // rank 0 <- expert 2 from rank 1
    CHECK(plan.steps[5].action == M::cross_node_copy);  // rank 1 <- expert 4 from rank 2
    CHECK(plan.steps[5].source_rank == 2);
    CHECK(plan.steps[11].action == M::cross_node_copy);  // rank 3 <- expert 0 from rank 0
  }
  if (size == 2) CHECK(plan.totals.count[a(M::same_node_copy)] == 2);

  auto const ledger = run_and_check(plan, source, target);
  // Small messages: every blob goes in several pieces.
  MigrationOptions chunked;
  chunked.max_message_bytes = 256;
  auto const ledger2 = run_and_check(plan, source, target, chunked);
  CHECK(ledger2.sent.bytes == ledger.sent.bytes);

  // The migrated digests publish the new generation.
  int const me = kmoe_test::world_rank();
  PlacementRegistry reg;
  reg.publish(source, gather_slot_digests(MPI_COMM_WORLD, source, [&] {
                std::vector<std::uint64_t> d;
                for (auto const& b : local_source_blobs(source, me)) d.push_back(digest_bytes(b.data(), b.size()));
                return d;
              }()));
  auto const all = gather_slot_digests(MPI_COMM_WORLD, target, ledger.target_digests);
  reg.publish(target, all);
  CHECK(reg.active_generation() == 2);
  CHECK(reg.state(1) == GenerationState::draining);
}

TEST_CASE("Migration over MPI: EPLB target", "[placement][migration][mpi]") {
  int const size = kmoe_test::world_size();
  auto const source = source_placement(size);
  auto const target = eplb_target(size);
  auto const plan = plan_migration(source, target, expert_bytes(source.num_experts()));
  check_plan(plan, source, target);
  if (size == 4) {
    CHECK(plan.totals.count[a(MigrationAction::cross_node_copy)] > 0);
    CHECK(plan.totals.count[a(MigrationAction::same_node_copy)] > 0);
  }
  run_and_check(plan, source, target);
}

TEST_CASE("Migration over MPI: corrupted parameters are a collective error", "[placement][migration][mpi]") {
  int const size = kmoe_test::world_size();
  int const me = kmoe_test::world_rank();
  auto const source = source_placement(size);
  auto const target = explicit_target(size);
  auto const plan = plan_migration(source, target, expert_bytes(source.num_experts()));
  // The last rank's first source slot (expert 2(R-1)) is corrupted; that
  // expert is copied to rank R-2 (or retained locally at one rank).
  auto blobs = local_source_blobs(source, me);
  if (me == size - 1) blobs[0][17] ^= 0x40;
  std::vector<ParameterBlob> out;
  std::string const pre = kmoe_test::collective_error_of([&] { execute_migration(MPI_COMM_WORLD, plan, source, target, blobs, out); });
  INFO(pre);
  CHECK(pre.find("migration validation failed on rank " + std::to_string(size - 1)) != std::string::npos);
  CHECK(pre.find("source slot " + std::to_string(2 * (size - 1))) != std::string::npos);

  // Without the source check, the receiving rank's digest check catches it.
  MigrationOptions no_check;
  no_check.verify_sources = false;
  std::string const post =
      kmoe_test::collective_error_of([&] { execute_migration(MPI_COMM_WORLD, plan, source, target, blobs, out, no_check); });
  INFO(post);
  int const receiver = size == 1 ? 0 : size - 2;
  CHECK(post.find("migration digest verification failed on rank " + std::to_string(receiver)) != std::string::npos);
  CHECK(post.find("from slot " + std::to_string(2 * (size - 1))) != std::string::npos);

  // Wrong blob sizes and target digests that cannot match their source.
  auto short_blobs = local_source_blobs(source, me);
  if (me == 0) short_blobs[1].pop_back();
  std::string const sz =
      kmoe_test::collective_error_of([&] { execute_migration(MPI_COMM_WORLD, plan, source, target, short_blobs, out); });
  CHECK(sz.find("source slot 1 (expert 1, rank 0) has 1036 bytes, the plan says 1037") != std::string::npos);
  auto digests = expert_digests(source.num_experts());
  digests[1] ^= 1;
  auto const wrong_target = target.with_expert_digests(digests, 1);
  auto const wrong_plan = plan_migration(source, wrong_target, expert_bytes(source.num_experts()));
  std::string const td = kmoe_test::collective_error_of(
      [&] { execute_migration(MPI_COMM_WORLD, wrong_plan, source, wrong_target, local_source_blobs(source, me), out); });
  CHECK(td.find("target slot 0 (expert 1, rank 0) expects digest") != std::string::npos);

  // Ranks holding different plans never start moving payload.
  if (size > 1) {
    auto const other = plan_migration(source, target, me == 0 ? std::int64_t(5) : std::int64_t(6));
    std::string const dp = kmoe_test::collective_error_of(
        [&] { execute_migration(MPI_COMM_WORLD, other, source, target, local_source_blobs(source, me), out); });
    CHECK(dp.find("the ranks hold different migration plans") != std::string::npos);
  }
}
