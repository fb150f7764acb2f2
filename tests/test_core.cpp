// The core building blocks every library shares: the labelled workspace
// (reuse only of buffers nobody holds), the row kit (every gather/scatter
// conversion against a plain loop, missing rows, records), and the option
// name tables (round trips of every enum, the error for an unknown name).

#include "kmoe_catch.hpp"
#include "kmoe_test_util.hpp"

#include <KokkosMoE_Admission.hpp>
#include <KokkosMoE_AllocationLog.hpp>
#include <KokkosMoE_BiasController.hpp>
#include <KokkosMoE_EnumNames.hpp>
#include <KokkosMoE_Eplb.hpp>
#include <KokkosMoE_Exchange_Config.hpp>
#include <KokkosMoE_Exchange_Ledger.hpp>
#include <KokkosMoE_Experts_Runner.hpp>
#include <KokkosMoE_Gemm.hpp>
#include <KokkosMoE_HostHeap.hpp>
#include <KokkosMoE_Migration.hpp>
#include <KokkosMoE_PlacementRegistry.hpp>
#include <KokkosMoE_Router.hpp>
#include <KokkosMoE_RowKit.hpp>
#include <KokkosMoE_Topology_Communicators.hpp>
#include <KokkosMoE_Workspace.hpp>

#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

using namespace KokkosMoE;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

TEST_CASE("workspace: buffers are reused only when nobody else holds them", "[core][workspace]") {
  Exec exec;
  Workspace<MS> ws("test");
  auto a = ws.matrix<float>(exec, "rows", 10, 4);
  float* const first = a.data();
  CHECK(a.extent(0) == 10);
  CHECK(a.extent(1) == 4);
  // Held by `a`: the same label gives another allocation, and the
  // workspace keeps both.
  auto b = ws.matrix<float>(exec, "rows", 10, 4);
  CHECK(b.data() != first);
  float* const second = b.data();
  CHECK(ws.buffers("rows") == 2);
  // Released: two requests in flight at once (a chunked step) get the
  // same two buffers again, no third; smaller requests included.
  a = {};
  b = {};
  auto c = ws.matrix<float>(exec, "rows", 6, 4);
  auto c2 = ws.matrix<float>(exec, "rows", 10, 4);
  CHECK(c.extent(0) == 6);
  CHECK(std::set<float*>{c.data(), c2.data()} == std::set<float*>{first, second});
  CHECK(ws.buffers("rows") == 2);
  c = {};
  c2 = {};
  // Grow-only: a larger request grows one buffer (the largest free), a
  // smaller one reuses it after; the smallest free buffer that fits is taken.
  auto d = ws.matrix<float>(exec, "rows", 25, 4);
  float* const grown = d.data();
  CHECK(ws.buffers("rows") == 2);
  d = {};
  auto e = ws.matrix<float>(exec, "rows", 12, 4);
  CHECK(e.data() == grown);
  auto e2 = ws.matrix<float>(exec, "rows", 3, 4);
  CHECK(e2.data() != grown);
  CHECK(ws.buffers("rows") == 2);
  e = {};
  e2 = {};
  // Another width or element type is another shape, with buffers of its
  // own: the old shape's stay for its next request.
  auto f = ws.matrix<float>(exec, "rows", 12, 5);
  CHECK(f.extent(1) == 5);
  CHECK(ws.buffers("rows") == 3);
  auto f4 = ws.matrix<float>(exec, "rows", 12, 4);
  CHECK(f4.data() == grown);
  auto fi = ws.matrix<int>(exec, "rows", 2, 4);
  CHECK(ws.buffers("rows") == 4);
  f4 = {};
  fi = {};
  auto g = ws.vector<index_t>(exec, "ids", 7);
  CHECK(g.extent(0) == 7);
  CHECK(ws.size() == 2);
  CHECK_THROWS_WITH(ws.vector<int>(exec, "bad", -1), Catch::Matchers::Contains("negative extent"));
  // An allocation that fails (new, or growing a free buffer) leaves the
  // label usable: the next request gets a buffer.
  index_t const huge = index_t(1) << 52;
  CHECK_THROWS(ws.vector<double>(exec, "fails", huge));
  CHECK(ws.vector<double>(exec, "fails", 5).extent(0) == 5);
  CHECK_THROWS(ws.vector<double>(exec, "fails", huge));  // grows the free one: released first, then fails
  CHECK(ws.buffers("fails") == 0);
  CHECK(ws.vector<double>(exec, "fails", 7).extent(0) == 7);
}

TEST_CASE("allocation log: sees every Kokkos allocation while it lives, one log at a time", "[core][workspace]") {
  Exec exec;
  Workspace<MS> ws("test");
  ws.vector<float>(exec, "held", 100);  // allocated before the log: not in it
  std::string seen;
  {
    AllocationLog log;
    CHECK_THROWS_WITH(AllocationLog(), Catch::Matchers::Contains("one at a time"));
    Kokkos::View<double*, MS> v("allocation_log::fresh", 5);
    Kokkos::View<int*, Kokkos::HostSpace> h("allocation_log::host", 3);
    ws.vector<float>(exec, "held", 100);   // reused: no allocation
    ws.vector<float>(exec, "held", 200);   // grown: one
    REQUIRE(log.count() == 3);
    CHECK(log.entries()[0].label == "allocation_log::fresh");
    CHECK(log.entries()[0].bytes >= 5 * sizeof(double));  // Kokkos may pad
    CHECK(log.entries()[1].label == "allocation_log::host");
    CHECK(log.entries()[2].label == "test::held");
    CHECK(log.bytes() >= 5 * sizeof(double) + 3 * sizeof(int) + 200 * sizeof(float));
    seen = log.text();
  }
  CHECK(seen.find("allocation_log::fresh (") != std::string::npos);
  {
    AllocationLog again;  // the first one is gone
    CHECK(again.count() == 0);
  }
}

TEST_CASE("host heap: a fixed mmap threshold maps large host views on their own and returns them when freed", "[core][heap]") {
  std::string const policy = stable_host_heap();
  HostHeapStats const before = host_heap_stats();
  CHECK(before.resident_mb > 0);
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) CHECK(policy == "mmap_threshold=" + std::to_string(stable_mmap_threshold_bytes));
  if (before.mapped_mb >= 0 && policy == "mmap_threshold=" + std::to_string(stable_mmap_threshold_bytes)) {
    double const mb = 8.0;
    double mapped_live = 0;
    {
      Kokkos::View<char*, Kokkos::HostSpace> big("host_heap::big", static_cast<std::size_t>(mb * 1024 * 1024));
      mapped_live = host_heap_stats().mapped_mb;
      CHECK(mapped_live >= before.mapped_mb + mb);
    }
    // Freed: its pages are unmapped, whatever was mapped before it stays.
    {
      Kokkos::View<char*, Kokkos::HostSpace> again("host_heap::again", static_cast<std::size_t>(mb * 1024 * 1024));
      CHECK(host_heap_stats().mapped_mb >= before.mapped_mb + mb);
    }
    CHECK(host_heap_stats().mapped_mb <= mapped_live - mb + 0.01);
  }
#else
  CHECK(!policy.empty());
#endif
}

namespace {

template <class T>
RowMatrix<T, MS> random_rows(int n, int d, unsigned seed) {
  RowMatrix<T, MS> m("rows", n, d);
  auto h = Kokkos::create_mirror_view(m);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) h(i, c) = from_float<T>(u(rng));
  Kokkos::deep_copy(m, h);
  return m;
}

template <class V>
std::vector<float> host_floats(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<float> out;
  for (std::size_t i = 0; i < h.extent(0); ++i)
    for (std::size_t c = 0; c < h.extent(1); ++c) out.push_back(to_float(h(i, c)));
  return out;
}

}  // namespace

TEST_CASE("row kit: gathers and scatters equal a plain loop for every conversion", "[core][rowkit]") {
  Exec exec;
  int const n = 37, d = 131;  // odd width: fp8 blocks and byte copies of odd length
  auto src = random_rows<float>(n, d, 5);
  auto const hs = host_floats(src);
  Kokkos::View<index_t*, MS> index("index", n);
  {
    auto h = Kokkos::create_mirror_view(index);
    for (int p = 0; p < n; ++p) h(p) = (p * 7 + 3) % n;  // a permutation
    Kokkos::deep_copy(index, h);
  }
  for (PayloadType const t : {PayloadType::fp32, PayloadType::bf16, PayloadType::fp8_row, PayloadType::fp8_block128}) {
    INFO(to_string(t));
    // encode gather, then decode scatter through the same index: row p of
    // the encoded buffer is source row index(p), and scattering it back puts
    // every row where it came from.
    PayloadBuffer<MS> wire("wire", t, d, n);
    gather_rows(exec, src, index, wire, "test::encode");
    RowMatrix<float, MS> back("back", n, d);
    scatter_rows(exec, wire, index, back, "test::decode");
    auto const hb = host_floats(back);
    // Reference: the per-row codec, row by row.
    PayloadBuffer<MS> one("one", t, d, 1);
    auto hw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), wire.bytes);
    auto hi = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), index);
    for (int p = 0; p < n; ++p) {
      index_t const s = hi(p);
      for (int c = 0; c < d; ++c) {
        float const want = Impl::payload_load(t, &hw(p, 0), d, c);
        REQUIRE(hb[static_cast<std::size_t>(s * d + c)] == want);
        if (t == PayloadType::fp32) REQUIRE(want == hs[static_cast<std::size_t>(s * d + c)]);
        if (t == PayloadType::bf16) REQUIRE(want == to_float(to_bf16(hs[static_cast<std::size_t>(s * d + c)])));
      }
    }
    // Payload to payload: byte copies, scales with their rows.
    PayloadBuffer<MS> moved("moved", t, d, n);
    gather_rows(exec, wire, KOKKOS_LAMBDA(index_t p)->index_t { return p; }, moved, "test::copy");
    auto hm = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), moved.bytes);
    CHECK(kmoe_test::same_bits(hm, hw));
  }
  // Typed to typed: bf16 rows round to nearest even, float to float is exact.
  auto bf = random_rows<bf16_t>(n, d, 9);
  RowMatrix<float, MS> wide("wide", n, d);
  gather_rows(exec, bf, index, wide, "test::widen");
  auto const hbf = host_floats(bf), hwide = host_floats(wide);
  auto hi = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), index);
  for (int p = 0; p < n; ++p)
    for (int c = 0; c < d; ++c) REQUIRE(hwide[static_cast<std::size_t>(p * d + c)] == hbf[static_cast<std::size_t>(hi(p) * d + c)]);
}

TEST_CASE("row kit: missing rows are skipped or zeroed; records move whole", "[core][rowkit]") {
  Exec exec;
  int const n = 8, d = 5;
  auto src = random_rows<float>(n, d, 11);
  RowMatrix<float, MS> dst("dst", n, d);
  Kokkos::deep_copy(dst, 7.0f);
  auto odd_missing = KOKKOS_LAMBDA(index_t p)->index_t { return p % 2 ? -1 : p; };
  gather_rows(exec, src, odd_missing, dst, "test::skip");
  auto h = host_floats(dst);
  auto hs = host_floats(src);
  for (int p = 0; p < n; ++p)
    for (int c = 0; c < d; ++c) CHECK(h[static_cast<std::size_t>(p * d + c)] == (p % 2 ? 7.0f : hs[static_cast<std::size_t>(p * d + c)]));
  gather_rows(exec, src, odd_missing, dst, "test::zero", MissingRow::zero);
  h = host_floats(dst);
  for (int p = 1; p < n; p += 2)
    for (int c = 0; c < d; ++c) CHECK(h[static_cast<std::size_t>(p * d + c)] == 0.0f);
  Kokkos::View<RowMeta*, MS> meta("meta", n), out("out", n);
  {
    auto hm = Kokkos::create_mirror_view(meta);
    for (int p = 0; p < n; ++p) hm(p) = RowMeta{p, 10 + p, 20 + p, 30 + p};
    Kokkos::deep_copy(meta, hm);
  }
  gather_records(exec, meta, KOKKOS_LAMBDA(index_t p)->index_t { return n - 1 - p; }, out, "test::records");
  auto ho = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out);
  for (int p = 0; p < n; ++p) CHECK(ho(p).route == 30 + (n - 1 - p));
  // Shapes are checked before any kernel runs.
  PayloadBuffer<MS> narrow("narrow", PayloadType::fp32, d + 1, n);
  CHECK_THROWS_WITH(gather_rows(exec, src, odd_missing, narrow, "test::bad"), Catch::Matchers::Contains("width 5 encoded into payload width 6"));
  auto cols = Kokkos::subview(src, Kokkos::ALL, std::pair<int, int>(0, 2));
  RowMatrix<float, MS> two("two", n, 2);
  CHECK_THROWS_WITH(gather_rows(exec, cols, odd_missing, two, "test::strided"), Catch::Matchers::Contains("not contiguous"));
}

TEST_CASE("row kit: payload parts read and write each row in the buffer its index names", "[core][rowkit]") {
  Exec exec;
  int const d = 6;
  index_t const n0 = 5, n1 = 3, n2 = 4, n3 = 2, n = n0 + n1 + n2 + n3;
  auto src = random_rows<float>(n, d, 13);
  PayloadBuffer<MS> all("all", PayloadType::fp32, d, n);
  gather_rows(exec, src, KOKKOS_LAMBDA(index_t p)->index_t { return p; }, all, "test::all");
  // The same rows split over four buffers: row p of part k is all's row base_k + p.
  PayloadBuffer<MS> a("a", PayloadType::fp32, d, n0), b("b", PayloadType::fp32, d, n1), c("c", PayloadType::fp32, d, n2),
      e("e", PayloadType::fp32, d, n3);
  copy_row_range(exec, a.bytes, 0, all.bytes, 0, n0);
  copy_row_range(exec, b.bytes, 0, all.bytes, n0, n1);
  copy_row_range(exec, c.bytes, 0, all.bytes, n0 + n1, n2);
  copy_row_range(exec, e.bytes, 0, all.bytes, n0 + n1 + n2, n3);
  // Row q of the result: all's row (q * 5) % n, named by its part.
  auto where = KOKKOS_LAMBDA(index_t q)->index_t {
    index_t const r = (q * 5) % n;
    return r < n0 ? part_row(0, r) : r < n0 + n1 ? part_row(1, r - n0) : r < n0 + n1 + n2 ? part_row(2, r - n0 - n1) : part_row(3, r - n0 - n1 - n2);
  };
  RowMatrix<float, MS> got("got", n, d);
  gather_rows(exec, PayloadParts<MS>{a, b, c, e}, where, got, "test::parts_gather");
  auto const hs = host_floats(src), hg = host_floats(got);
  for (index_t q = 0; q < n; ++q)
    for (int j = 0; j < d; ++j) REQUIRE(hg[static_cast<std::size_t>(q * d + j)] == hs[static_cast<std::size_t>(((q * 5) % n) * d + j)]);
  // Scattered back through the same index into fresh parts: every part holds its rows again.
  PayloadBuffer<MS> a2("a2", PayloadType::fp32, d, n0), b2("b2", PayloadType::fp32, d, n1), c2("c2", PayloadType::fp32, d, n2),
      e2("e2", PayloadType::fp32, d, n3);
  scatter_rows(exec, got, where, PayloadParts<MS>{a2, b2, c2, e2}, "test::parts_scatter");
  for (auto const& [x, y] : {std::pair<PayloadBuffer<MS>, PayloadBuffer<MS>>{a, a2}, {b, b2}, {c, c2}, {e, e2}}) {
    auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x.bytes);
    auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y.bytes);
    CHECK(kmoe_test::same_bits(hx, hy));
  }
  // An absent part (no rows) takes the others' shape; parts of another width are refused.
  RowMatrix<float, MS> two("two", n0, d);
  gather_rows(exec, PayloadParts<MS>{a, PayloadBuffer<MS>{}, PayloadBuffer<MS>{}, PayloadBuffer<MS>{}}, KOKKOS_LAMBDA(index_t q)->index_t { return q; }, two,
              "test::parts_absent");
  CHECK(host_floats(two) == std::vector<float>(hs.begin(), hs.begin() + n0 * d));
  PayloadBuffer<MS> wide("wide", PayloadType::fp32, d + 1, 2);
  CHECK_THROWS_WITH(gather_rows(exec, PayloadParts<MS>{a, wide, c, e}, where, got, "test::parts_bad"),
                    Catch::Matchers::Contains("payload width 7 decoded into rows of width 6"));
}

namespace {

template <class E>
void round_trip() {
  auto const names = enum_names<E>();
  CHECK(!names.empty());
  std::set<std::string> unique(names.begin(), names.end());
  CHECK(unique.size() == names.size());
  for (auto const& n : names) CHECK(to_string(from_string<E>(n)) == n);
}

}  // namespace

TEST_CASE("option names: one table per enum, round trips, clear errors", "[core][names]") {
  round_trip<PayloadType>();
  round_trip<GemmPath>();
  round_trip<ScoreFunction>();
  round_trip<SetScore>();
  round_trip<AdmissionPolicy>();
  round_trip<BiasUpdateRule>();
  round_trip<ReplicaPolicy>();
  round_trip<PlacementPolicy>();
  round_trip<MigrationAction>();
  round_trip<GenerationState>();
  round_trip<Topology::LayoutKind>();
  round_trip<Topology::RelayPolicy>();
  round_trip<Exchange::Algorithm>();
  round_trip<Exchange::TransportKind>();
  round_trip<Exchange::LinkClass>();
  round_trip<Experts::RunnerKind>();
  round_trip<Experts::GroupedKernel>();
  round_trip<Experts::WeightDType>();
  CHECK(to_string(Topology::LayoutKind::virtual_nodes) == "virtual");
  CHECK(to_string(PlacementPolicy::explicit_slots) == "explicit");
  CHECK(to_string(GemmPath::automatic) == "auto");
  CHECK(enum_names<Exchange::Algorithm>() == std::vector<std::string>{"flat", "hierarchical", "pooled_wave", "hierarchical_dedup"});
  CHECK_THROWS_WITH(from_string<Exchange::TransportKind>("ucx"),
                    Catch::Matchers::StartsWith("KokkosMoE error: unknown exchange transport 'ucx' (expected 'mpi' or 'nccl')"));
  CHECK(quoted_alternatives({"a", "b", "c"}) == "'a', 'b' or 'c'");
}

TEST_CASE("row kit: fp8 rows without their scales are refused before any row moves", "[core][rowkit][fault]") {
  Exec exec;
  int const n = 4, d = 8;
  PayloadBuffer<MS> fp8;
  fp8.type = PayloadType::fp8_row;
  fp8.width = d;
  fp8.bytes = PayloadBuffer<MS>::bytes_view("fp8 without scales", n, d);  // d elements, no FP32 scale
  RowMatrix<float, MS> x("x", n, d);
  Kokkos::deep_copy(x, -1.0f);
  CHECK_THROWS_WITH(scatter_rows(exec, fp8, KOKKOS_LAMBDA(index_t p)->index_t { return p; }, x, "test::decode"),
                    Catch::Matchers::Contains("payload rows of 8 bytes, but fp8_row rows of width 8 are 12 bytes (elements and their FP32 scales)"));
  auto h = host_floats(x);
  for (float v : h) CHECK(v == -1.0f);  // nothing was decoded
}
