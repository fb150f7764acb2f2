// Host micro-kernels for the baseline instruction set of the build (16-byte
// vectors: SSE2 on x86-64, NEON on Arm); always built.

#define KOKKOSMOE_EXPERTS_ISA_NS generic
#define KOKKOSMOE_EXPERTS_VECTOR_BYTES 16
#include <impl/KokkosMoE_Experts_HostKernelBody.hpp>

namespace KokkosMoE {
namespace Experts {
namespace Impl {

void fill_host_kernels_generic(HostKernelTable& t) {
  t.isa = "generic";
  t.vector_length = generic::VL;
  t.max_vectors = 4;
  generic::set_kernel<4, 6>(t);
  generic::set_kernel<3, 8>(t);
  generic::set_kernel<2, 12>(t);
  generic::set_kernel<1, 12>(t);
  generic::set_decode_kernels(t);
  generic::set_elementwise_kernels(t);
}

}  // namespace Impl
}  // namespace Experts
}  // namespace KokkosMoE
