// Run-time choice of the host micro-kernel table from the CPU's features.

#include <impl/KokkosMoE_Experts_HostKernels.hpp>

#include <KokkosMoE_Error.hpp>

#include <sstream>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

namespace {

[[maybe_unused]] bool cpu_has_avx512() {
#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX512) && (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

[[maybe_unused]] bool cpu_has_avx512bf16() {
#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX512BF16) && (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

[[maybe_unused]] bool cpu_has_avx2() {
#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX2) && (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

struct Tables {
  HostKernelTable avx512, avx2, generic;
  bool have_avx512 = false, have_avx2 = false;
  Tables() {
    fill_host_kernels_generic(generic);
#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX2)
    have_avx2 = cpu_has_avx2();
    if (have_avx2) fill_host_kernels_avx2(avx2);
#endif
#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX512)
    have_avx512 = cpu_has_avx512();
    if (have_avx512) fill_host_kernels_avx512(avx512);
#endif
#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX512BF16)
    if (have_avx512 && cpu_has_avx512bf16()) fill_host_kernels_avx512bf16(avx512);
#endif
  }
};

Tables const& tables() {
  static Tables const t;
  return t;
}

}  // namespace

HostKernelTable const& host_kernel_table() {
  Tables const& t = tables();
  if (t.have_avx512) return t.avx512;
  if (t.have_avx2) return t.avx2;
  return t.generic;
}

std::vector<std::string> host_kernel_isas() {
  Tables const& t = tables();
  std::vector<std::string> isas;
  if (t.have_avx512) isas.push_back("avx512");
  if (t.have_avx2) isas.push_back("avx2");
  isas.push_back("generic");
  return isas;
}

HostKernelTable const& host_kernel_table(std::string const& isa) {
  Tables const& t = tables();
  if (isa.empty() || isa == "auto") return host_kernel_table();
  if (isa == "avx512" && t.have_avx512) return t.avx512;
  if (isa == "avx2" && t.have_avx2) return t.avx2;
  if (isa == "generic") return t.generic;
  std::ostringstream os;
  for (auto const& name : host_kernel_isas()) os << (os.tellp() > 0 ? ", " : "") << name;
  KOKKOSMOE_THROW("Experts: host kernel instruction set '" << isa << "' is not available in this build on this CPU (available: "
                                                           << os.str() << ", or auto)");
}

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE
