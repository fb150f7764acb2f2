#include <KokkosMoE_Error.hpp>
#include <KokkosMoE_Payload.hpp>

namespace KokkosMoE {

std::string to_string(PayloadType t) {
  switch (t) {
    case PayloadType::fp32: return "fp32";
    case PayloadType::bf16: return "bf16";
    case PayloadType::fp8_row: return "fp8_row";
    case PayloadType::fp8_block128: return "fp8_block128";
  }
  return "unknown";
}

PayloadType payload_type_from_string(std::string const& name) {
  for (PayloadType t : {PayloadType::fp32, PayloadType::bf16, PayloadType::fp8_row, PayloadType::fp8_block128}) {
    if (to_string(t) == name) return t;
  }
  KOKKOSMOE_THROW("unknown payload type '" << name << "' (expected fp32, bf16, fp8_row or fp8_block128)");
}

}  // namespace KokkosMoE
