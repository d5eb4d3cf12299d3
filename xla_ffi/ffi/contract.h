// The contract between a lowered program and these handlers: the operands every target takes (the
// call's position first: runtime/placement.h) and the attributes of ffi/attrs.h. A program lives
// longer than the library that lowered it (a `jax.export` artifact, a persistent compilation cache),
// so every call carries the contract's version as its attribute `ficco_abi`
// (ficco_jax/lowering/dma/registry.py, CONTRACT_VERSION), and a call of another version is refused by
// name before XLA decodes anything else, instead of failing on an operand or attribute it cannot
// place. Any change to a target's operands or attributes raises the version.
#ifndef FICCO_JAX_XLA_FFI_FFI_CONTRACT_H_
#define FICCO_JAX_XLA_FFI_FFI_CONTRACT_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/c_api.h"

namespace ficco {

inline constexpr int64_t kContractVersion = 2;
inline constexpr char kContractAttribute[] = "ficco_abi";

// Null where `frame` may be decoded (a metadata query, or a call of this version), else the error
// that names both versions and the fix.
inline XLA_FFI_Error* CheckContract(XLA_FFI_CallFrame* frame, const char* target) {
  if (frame->extension_start != nullptr && frame->extension_start->type == XLA_FFI_Extension_Metadata) return nullptr;
  int64_t found = -1;
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* name = frame->attrs.names[i];
    if (name->len != std::strlen(kContractAttribute) ||
        std::memcmp(name->ptr, kContractAttribute, name->len) != 0) {
      continue;
    }
    const auto* scalar = static_cast<const XLA_FFI_Scalar*>(frame->attrs.attrs[i]);
    if (frame->attrs.types[i] == XLA_FFI_AttrType_SCALAR && scalar->dtype == XLA_FFI_DataType_S64) {
      found = *static_cast<const int64_t*>(scalar->value);
    }
  }
  if (found == kContractVersion) return nullptr;
  const std::string message =
      std::string("ficco_jax: ") + target + ": this program was lowered by a ficco_jax whose calls follow " +
      (found < 0 ? std::string("an older contract (no ficco_abi attribute)")
                 : "contract version " + std::to_string(found)) +
      ", and this extension follows version " + std::to_string(kContractVersion) +
      "; lower or export the program again with the installed ficco_jax, or load it with the ficco_jax that made it";
  XLA_FFI_Error_Create_Args args;
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.message = message.c_str();
  args.errc = XLA_FFI_Error_Code_INVALID_ARGUMENT;
  return frame->api->XLA_FFI_Error_Create(&args);
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_FFI_CONTRACT_H_
