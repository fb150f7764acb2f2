#ifndef KOKKOSMOE_IMPL_ROUTERSELECT_HPP
#define KOKKOSMOE_IMPL_ROUTERSELECT_HPP

/// \file impl/KokkosMoE_RouterSelect.hpp
/// \brief The router's per-token kernel: score function, correction bias,
/// group- or domain-limited candidate sets, top-k by insertion, gates.
///
/// One thread owns one token. Every ordering uses the total order
/// "larger value first, then lower index", so the result does not depend on
/// the order in which candidates are visited, the backend or the thread
/// count. NaN selection values count as -infinity.

#include <KokkosMoE_KokkosCompat.hpp>
#include <KokkosMoE_Payload.hpp>
#include <KokkosMoE_Types.hpp>
#include <impl/KokkosMoE_OrderKeys.hpp>

#include <cstdint>

namespace KokkosMoE {
namespace Impl {

/// Largest number of scores summed by a top-m group or domain score.
constexpr int router_max_top_m = 16;

/// 64-bit key of (value, index) ordered like comes_before: a larger key comes
/// first. Every real key is > 0, so 0 marks an empty slot.
KOKKOS_INLINE_FUNCTION std::uint64_t select_key(float v, int idx) {
  return (static_cast<std::uint64_t>(float_order_bits(v)) << 32) | (0xFFFFFFFFu - static_cast<std::uint32_t>(idx));
}
KOKKOS_INLINE_FUNCTION int key_index(std::uint64_t key) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<std::uint32_t>(key & 0xFFFFFFFFu));
}

/// True when (sa, a) comes before (sb, b): larger value, then lower index.
KOKKOS_INLINE_FUNCTION bool comes_before(float sa, int a, float sb, int b) {
  return sa > sb || (sa == sb && a < b);
}

/// exp(x) for the score functions: Cephes-style reduction x = n ln2 + r and
/// a degree-6 polynomial, within 1 ulp of exp(x) for |x| <= 87.6. |x| is
/// clamped to 88 (exp(+-inf) gives 1.65e38 / 0; results below the smallest
/// normal float flush to 0); NaN stays NaN. The clamp works on the bit
/// pattern (integer compares), so loops over it vectorize without
/// -fno-trapping-math, and there are no library calls. Its products go
/// through mul_rn, so a device compiler fusing them with the adds (nvcc's
/// default) cannot change its bits: the same on every backend.
KOKKOS_INLINE_FUNCTION float exp_poly(float x) {
  std::uint32_t const u = float_bits(x);
  std::uint32_t const a = u & 0x7FFFFFFFu;
  std::uint32_t const lim = 0x42B00000u;                              // 88.0f
  std::uint32_t const xb = a > lim ? ((u & 0x80000000u) | lim) : u;  // |xc| <= 88 (NaN -> +-88)
  float const xc = bits_float(xb);
  float const xr = bits_float(a > 0x7F800000u ? u : xb);  // NaN kept for the polynomial
  // n = floor(xc / ln2 + 0.5); the shifted argument is positive, so truncation is floor.
  int const n = static_cast<int>(Compat::mul_rn(xc, 1.44269504088896341f) + 128.5f) - 128;
  float const nf = static_cast<float>(n);
  using Compat::mul_rn;
  float r = xr - mul_rn(nf, 0.693359375f);  // ln2 in two parts: the reduction is exact
  r = r - mul_rn(nf, -2.12194440e-4f);
  float const z = r * r;
  float p = 1.9875691500e-4f;
  p = mul_rn(p, r) + 1.3981999507e-3f;
  p = mul_rn(p, r) + 8.3334519073e-3f;
  p = mul_rn(p, r) + 4.1665795894e-2f;
  p = mul_rn(p, r) + 1.6666665459e-1f;
  p = mul_rn(p, r) + 5.0000001201e-1f;
  p = mul_rn(p, z) + r + 1.0f;
  return p * bits_float(static_cast<std::uint32_t>(n + 127) << 23);  // n = -127 gives 0
}

/// Score function codes of the kernel (mirror ScoreFunction).
enum class KernelScore : int { softmax = 0, sigmoid = 1, identity = 2 };
/// Limit codes of the kernel.
enum class KernelLimit : int { none = 0, groups = 1, domains = 2 };
/// Set-score codes (group or domain): max, or sum of the top m values.
enum class KernelSetScore : int { max = 0, top_m_sum = 1 };

/// Sum of the m largest of n values v(i) added largest first (sum of the
/// min(m, n) largest when n < m); max when mode is KernelSetScore::max.
/// NaN values count as -infinity.
template <class ValueOf>
KOKKOS_INLINE_FUNCTION float set_score(KernelSetScore mode, int m, int n, ValueOf const& v) {
  if (mode == KernelSetScore::max || m == 1) {
    float best = neg_infinity();
    for (int i = 0; i < n; ++i) {
      float const x = v(i);
      best = Compat::max(best, x);  // max(best, NaN) = best
    }
    return best;
  }
  if (m == 2) {
    // Branchless running top-2. Compat::max(a, b) = a < b ? b : a keeps a
    // when b is NaN, so a NaN x never enters (b0, b1): it counts as -infinity.
    float b0 = neg_infinity(), b1 = neg_infinity();
    for (int i = 0; i < n; ++i) {
      float const x = v(i);
      b1 = Compat::min(b0, Compat::max(b1, x));  // median of (b1 <= b0, x): the new second largest
      b0 = Compat::max(b0, x);
    }
    return n >= 2 ? b0 + b1 : b0;
  }
  float top[router_max_top_m];
  int const mm = Compat::min(m, n);
  for (int i = 0; i < mm; ++i) top[i] = neg_infinity();
  for (int i = 0; i < n; ++i) {
    float const x = v(i);
    if (mm == 0 || !(x > top[mm - 1])) continue;  // NaN never enters
    int j = mm - 1;
    while (j > 0 && x > top[j - 1]) {
      top[j] = top[j - 1];
      --j;
    }
    top[j] = x;
  }
  float s = 0.0f;
  for (int i = 0; i < mm; ++i) s = i == 0 ? top[0] : s + top[i];
  return s;
}

/// Inserts index c into the best-first index list (length n, -1 = empty),
/// ordered by value(idx) then lower idx.
template <class ValueOf>
KOKKOS_INLINE_FUNCTION void insert_index(int* list, int n, int c, ValueOf const& value) {
  float const vc = value(c);
  auto before = [&](int other) { return other < 0 || comes_before(vc, c, value(other), other); };
  if (!before(list[n - 1])) return;
  int j = n - 1;
  while (j > 0 && before(list[j - 1])) {
    list[j] = list[j - 1];
    --j;
  }
  list[j] = c;
}

/// The per-token router kernel. Views are [rows, columns] LayoutRight.
/// K > 0: the top-k list lives in registers as K 64-bit keys (k <= K; the
/// first k of the top-K are the top-k); K == 0: in the output rows (any k).
template <class MemorySpace, int K>
struct RouterSelect {
  using M = MemorySpace;
  template <class T>
  using Mat = Kokkos::View<T**, Kokkos::LayoutRight, M>;

  Mat<const float> input;        ///< [T, E] logits (or scores for identity)
  Mat<float> scores;             ///< [T, E] score-function output
  Kokkos::View<const float*, M> bias;  ///< [E] correction bias, or zeros
  Mat<int> expert;               ///< [T, k]
  Mat<float> gate;               ///< [T, k]
  Mat<float> affinity;           ///< [T, k] original score of every selected expert
  Mat<float> set_scores;         ///< [T, G or D] group / domain scores (limit != none)
  Mat<int> kept;                 ///< [T, topk_groups or max_domains] kept groups / domains
  Kokkos::View<const int*, M> domain_offsets;  ///< [D + 1]
  Kokkos::View<const int*, M> domain_members;  ///< [E] experts of each domain, ascending
  int E = 0, k = 0;
  int num_sets = 0, keep_sets = 0, group_size = 0, top_m = 2;
  KernelScore score = KernelScore::softmax;
  KernelLimit limit = KernelLimit::none;
  KernelSetScore set_mode = KernelSetScore::max;
  bool normalize = false;
  float route_scale = 1.0f;
  bool zero_masked = false;  ///< group limit: the dropped groups' experts compete with selection value 0

  /// Selection value of expert e of a token with scores s (bias holds zeros
  /// when the correction bias is disabled: s + 0 compares equal to s).
  KOKKOS_INLINE_FUNCTION float sel(float const* s, int e) const { return s[e] + bias(e); }

  /// Calls f(e, v) for every expert the limits leave eligible (any order),
  /// v its selection value (0 for a dropped group's expert with zero_masked).
  template <class F>
  KOKKOS_INLINE_FUNCTION void for_each_candidate(index_t t, float const* s, F const& f) const {
    if (limit == KernelLimit::none) {
      for (int e = 0; e < E; ++e) f(e, sel(s, e));
    } else if (limit == KernelLimit::groups) {
      float* const gs = &set_scores(t, 0);
      for (int g = 0; g < num_sets; ++g) {
        int const base = g * group_size;
        gs[g] = select_value(set_score(set_mode, top_m, group_size, [&](int i) { return sel(s, base + i); }));
      }
      int* const kg = &kept(t, 0);
      for (int j = 0; j < keep_sets; ++j) kg[j] = -1;
      auto gval = [&](int g) { return gs[g]; };
      for (int g = 0; g < num_sets; ++g) insert_index(kg, keep_sets, g, gval);
      if (zero_masked) {
        for (int e = 0; e < E; ++e) {
          int const g = e / group_size;
          bool in = false;
          for (int j = 0; j < keep_sets; ++j) in = in || kg[j] == g;
          f(e, in ? sel(s, e) : 0.0f);
        }
        return;
      }
      for (int j = 0; j < keep_sets; ++j) {
        int const base = kg[j] * group_size;
        for (int e = base; e < base + group_size; ++e) f(e, sel(s, e));
      }
    } else {
      float* const ds = &set_scores(t, 0);
      int* const kd = &kept(t, 0);
      for (int j = 0; j < keep_sets; ++j) kd[j] = -1;
      auto dval = [&](int d) { return ds[d]; };
      for (int d = 0; d < num_sets; ++d) {
        int const lo = domain_offsets(d), n = domain_offsets(d + 1) - lo;
        ds[d] = neg_infinity();
        if (n == 0) continue;  // an empty domain is never kept
        ds[d] = select_value(set_score(set_mode, top_m, n, [&](int i) { return sel(s, domain_members(lo + i)); }));
        insert_index(kd, keep_sets, d, dval);
      }
      for (int j = 0; j < keep_sets; ++j) {
        int const d = kd[j];
        if (d < 0) continue;
        for (int i = domain_offsets(d); i < domain_offsets(d + 1); ++i) f(domain_members(i), sel(s, domain_members(i)));
      }
    }
  }

  KOKKOS_INLINE_FUNCTION void operator()(index_t t) const {
    float* const s = &scores(t, 0);
    compute_scores(t, s);
    int* const ti = &expert(t, 0);
    if constexpr (K > 0) {
      std::uint64_t top[K];
      for (int j = 0; j < K; ++j) top[j] = 0;
      float last = neg_infinity();  // value of top[K - 1] once the list is full
      for_each_candidate(t, s, [&](int e, float v) {
        if (v < last) return;  // cheap reject; ties and NaN take the exact path
        std::uint64_t const key = select_key(v, e);
        if (key <= top[K - 1]) return;
        // Branchless insertion, from the back so top[j - 1] is still the old value.
        for (int j = K - 1; j > 0; --j) top[j] = key > top[j - 1] ? top[j - 1] : (key > top[j] ? key : top[j]);
        top[0] = key > top[0] ? key : top[0];
        if (top[K - 1] != 0) last = order_bits_float(static_cast<std::uint32_t>(top[K - 1] >> 32));
      });
      for (int j = 0; j < k; ++j) ti[j] = key_index(top[j]);
    } else {
      // Best-first list in the output rows (values in gate).
      float* const ts = &gate(t, 0);
      for (int j = 0; j < k; ++j) {
        ts[j] = neg_infinity();
        ti[j] = 0x7FFFFFFF;
      }
      for_each_candidate(t, s, [&](int e, float value) {
        float const v = select_value(value);
        if (!comes_before(v, e, ts[k - 1], ti[k - 1])) return;
        int j = k - 1;
        while (j > 0 && comes_before(v, e, ts[j - 1], ti[j - 1])) {
          ts[j] = ts[j - 1];
          ti[j] = ti[j - 1];
          --j;
        }
        ts[j] = v;
        ti[j] = e;
      });
    }

    // Gates from the original scores of the selected experts.
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      float const a = s[ti[j]];
      affinity(t, j) = a;
      sum += a;
    }
    float const denom = (normalize && sum > 0.0f) ? sum : 1.0f;
    for (int j = 0; j < k; ++j) gate(t, j) = (affinity(t, j) / denom) * route_scale;
  }

  KOKKOS_INLINE_FUNCTION void compute_scores(index_t t, float* s) const {
    float const* const x = &input(t, 0);
    if (score == KernelScore::identity) {
      for (int e = 0; e < E; ++e) s[e] = x[e];
    } else if (score == KernelScore::sigmoid) {
      for (int e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + exp_poly(-x[e]));
    } else {
      // Softmax; max and sum use 8 partial lanes combined in a fixed order.
      constexpr int L = 8;
      float mx[L], sum[L];
      for (int l = 0; l < L; ++l) {
        mx[l] = neg_infinity();
        sum[l] = 0.0f;
      }
      for (int e = 0; e < E; ++e) mx[e % L] = Compat::max(mx[e % L], x[e]);
      float m = mx[0];
      for (int l = 1; l < L; ++l) m = Compat::max(m, mx[l]);
      for (int e = 0; e < E; ++e) s[e] = exp_poly(x[e] - m);
      for (int e = 0; e < E; ++e) sum[e % L] += s[e];
      float total = sum[0];
      for (int l = 1; l < L; ++l) total += sum[l];
      float const inv = 1.0f / total;
      for (int e = 0; e < E; ++e) s[e] *= inv;
    }
  }
};

/// The router kernel with a team of vector lanes per token (the GPU mapping):
/// scores over lanes, group/domain scores one set per lane, then every lane
/// keeps the best K candidate keys of its strided experts in team scratch
/// and k rounds of a vector max pick the winners. Every result equals
/// RouterSelect's bit for bit, on any backend (softmax sums keep the 8 fixed
/// partial sums; keys order totally; exp_poly's products are never fused).
/// K in {1, 2, 4, 8, 16}: k <= K.
template <class MemorySpace, int K>
struct RouterSelectTeam : RouterSelect<MemorySpace, K> {
  static_assert(K > 0, "RouterSelectTeam keeps K keys per lane");
  static constexpr int lanes = 32;    ///< candidate lists per token
  static constexpr int partials = 8;  ///< softmax partial sums (RouterSelect's order)
  using Base = RouterSelect<MemorySpace, K>;
  using Base::sel;

  Kokkos::View<const int*, MemorySpace> domain_of;  ///< [E] domain of every expert (domain limit)
  index_t num_tokens = 0;
  int tokens_per_team = 1;

  /// Team scratch bytes per token.
  KOKKOS_INLINE_FUNCTION static constexpr std::size_t bytes_per_token() {
    return sizeof(std::uint64_t) * lanes * K + sizeof(int) * lanes + sizeof(float) * partials;
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(Member const& team) const {
    int const slot = team.team_rank();
    index_t const t = static_cast<index_t>(team.league_rank()) * tokens_per_team + slot;
    bool const valid = t < num_tokens;
    char* base = static_cast<char*>(team.team_shmem().get_shmem(bytes_per_token() * tokens_per_team));
    base += bytes_per_token() * static_cast<std::size_t>(slot);
    std::uint64_t* const lists = reinterpret_cast<std::uint64_t*>(base);  // [lanes][K]
    int* const head = reinterpret_cast<int*>(lists + lanes * K);          // [lanes]
    float* const part = reinterpret_cast<float*>(head + lanes);           // [partials]
    int const E = this->E;
    float* const s = valid ? &this->scores(t, 0) : nullptr;
    float const* const x = valid ? &this->input(t, 0) : nullptr;

    // 1. Scores (softmax: max and sum over RouterSelect's 8 fixed partials).
    bool const softmax = valid && this->score == KernelScore::softmax;
    if (softmax) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, partials), [&](int l) {
        float mx = neg_infinity();
        for (int e = l; e < E; e += partials) mx = Compat::max(mx, x[e]);
        part[l] = mx;
      });
    }
    team.team_barrier();
    if (softmax) {
      float m = part[0];
      for (int l = 1; l < partials; ++l) m = Compat::max(m, part[l]);
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, E), [&](int e) { s[e] = exp_poly(x[e] - m); });
    } else if (valid) {
      bool const sig = this->score == KernelScore::sigmoid;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, E),
                           [&](int e) { s[e] = sig ? 1.0f / (1.0f + exp_poly(-x[e])) : x[e]; });
    }
    team.team_barrier();
    if (softmax) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, partials), [&](int l) {
        float p = 0.0f;
        for (int e = l; e < E; e += partials) p += s[e];
        part[l] = p;
      });
    }
    team.team_barrier();
    if (softmax) {
      float total = part[0];
      for (int l = 1; l < partials; ++l) total += part[l];
      float const inv = 1.0f / total;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, E), [&](int e) { s[e] *= inv; });
    }
    team.team_barrier();

    // 2. Group or domain scores, one set per lane; one lane keeps the best.
    if (valid && this->limit != KernelLimit::none) {
      float* const ss = &this->set_scores(t, 0);
      bool const groups = this->limit == KernelLimit::groups;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, this->num_sets), [&](int g) {
        if (groups) {
          int const b = g * this->group_size;
          ss[g] = select_value(set_score(this->set_mode, this->top_m, this->group_size, [&](int i) { return sel(s, b + i); }));
        } else {
          int const lo = this->domain_offsets(g), n = this->domain_offsets(g + 1) - lo;
          ss[g] = n == 0 ? neg_infinity()
                         : select_value(set_score(this->set_mode, this->top_m, n,
                                                  [&](int i) { return sel(s, this->domain_members(lo + i)); }));
        }
      });
    }
    team.team_barrier();
    if (valid && this->limit != KernelLimit::none) {
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        float const* const ss = &this->set_scores(t, 0);
        int* const kept = &this->kept(t, 0);
        for (int j = 0; j < this->keep_sets; ++j) kept[j] = -1;
        auto val = [&](int g) { return ss[g]; };
        bool const groups = this->limit == KernelLimit::groups;
        for (int g = 0; g < this->num_sets; ++g) {
          if (!groups && this->domain_offsets(g + 1) == this->domain_offsets(g)) continue;  // never kept
          insert_index(kept, this->keep_sets, g, val);
        }
      });
    }
    team.team_barrier();

    // 3. Each lane's best K candidate keys (descending), then k rounds of a max.
    if (valid) {
      int const* const kept = this->limit != KernelLimit::none ? &this->kept(t, 0) : nullptr;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, lanes), [&](int l) {
        std::uint64_t top[K];
        for (int j = 0; j < K; ++j) top[j] = 0;
        for (int e = l; e < E; e += lanes) {
          float value = sel(s, e);
          if (kept) {
            int const set = this->limit == KernelLimit::groups ? e / this->group_size : domain_of(e);
            bool in = false;
            for (int j = 0; j < this->keep_sets; ++j) in = in || kept[j] == set;
            if (!in && !this->zero_masked) continue;
            value = in ? value : 0.0f;
          }
          std::uint64_t const key = select_key(value, e);
          if (key <= top[K - 1]) continue;
          for (int j = K - 1; j > 0; --j) top[j] = key > top[j - 1] ? top[j - 1] : (key > top[j] ? key : top[j]);
          top[0] = key > top[0] ? key : top[0];
        }
        for (int j = 0; j < K; ++j) lists[l * K + j] = top[j];
        head[l] = 0;
      });
    }
    team.team_barrier();
    if (valid) {
      int* const ti = &this->expert(t, 0);
      for (int j = 0; j < this->k; ++j) {
        std::uint64_t best = 0;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, lanes),
            [&](int l, std::uint64_t& b) {
              std::uint64_t const key = head[l] < K ? lists[l * K + head[l]] : 0;
              if (key > b) b = key;
            },
            Kokkos::Max<std::uint64_t>(best));
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, lanes), [&](int l) {
          if (head[l] < K && lists[l * K + head[l]] == best) ++head[l];
        });
        Kokkos::single(Kokkos::PerThread(team), [&]() { ti[j] = key_index(best); });
      }
    }
    team.team_barrier();

    // 4. Gates from the original scores of the selected experts.
    if (valid) {
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        int const* const ti = &this->expert(t, 0);
        float sum = 0.0f;
        for (int j = 0; j < this->k; ++j) {
          float const a = s[ti[j]];
          this->affinity(t, j) = a;
          sum += a;
        }
        float const denom = (this->normalize && sum > 0.0f) ? sum : 1.0f;
        for (int j = 0; j < this->k; ++j) this->gate(t, j) = (this->affinity(t, j) / denom) * this->route_scale;
      });
    }
  }
};

}  // namespace Impl
}  // namespace KokkosMoE

#endif
