// Host micro-kernels for AVX2 + FMA (16 vector registers of 8 floats);
// compiled with -mavx2 -mfma when the build enables it, empty otherwise.

#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX2) && defined(__AVX2__) && defined(__FMA__)

#define KOKKOSMOE_EXPERTS_ISA_NS avx2
#define KOKKOSMOE_EXPERTS_VECTOR_BYTES 32
#include <impl/KokkosMoE_Experts_HostKernelBody.hpp>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

// 12 accumulators + row vectors + one broadcast stay within 16 registers.
void fill_host_kernels_avx2(HostKernelTable& t) {
  t.isa = "avx2";
  t.vector_length = avx2::VL;
  t.max_vectors = 2;
  avx2::set_kernel<2, 6>(t);
  avx2::set_kernel<1, 12>(t);
  avx2::set_decode_kernels(t);
  avx2::set_elementwise_kernels(t);
}

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
