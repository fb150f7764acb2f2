// Host micro-kernels for AVX-512 (32 vector registers of 16 floats); compiled
// with -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma when the build
// enables it, empty otherwise.

#if defined(KOKKOSMOE_EXPERTS_BUILD_AVX512) && defined(__AVX512F__)

#define KOKKOSMOE_EXPERTS_ISA_NS avx512
#define KOKKOSMOE_EXPERTS_VECTOR_BYTES 64
#include <impl/KokkosMoE_Experts_HostKernelBody.hpp>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

// 24 accumulators + row vectors + one broadcast stay within 32 registers.
void fill_host_kernels_avx512(HostKernelTable& t) {
  t.isa = "avx512";
  t.vector_length = avx512::VL;
  t.max_vectors = 4;
  avx512::set_kernel<4, 6>(t);
  avx512::set_kernel<3, 8>(t);
  avx512::set_kernel<2, 12>(t);
  avx512::set_kernel<1, 12>(t);
  avx512::set_decode_kernels(t);
  avx512::set_elementwise_kernels(t);
}

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE

#endif
