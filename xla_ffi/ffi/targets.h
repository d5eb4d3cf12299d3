// Every ficco FFI target with its CPU and CUDA entry points, for module.cc to hand to Python.
#ifndef FICCO_JAX_XLA_FFI_FFI_TARGETS_H_
#define FICCO_JAX_XLA_FFI_FFI_TARGETS_H_

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace ficco {

using FfiEntry = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);

struct TargetEntries {
  const char* name;
  FfiEntry instantiate;      // the instantiate stage of every entry (the Placement: runtime/placement.h)
  FfiEntry cpu;
  FfiEntry cuda;            // nullptr without the CUDA build
  bool symmetric;           // has a transfer=symmetric form, registered as <name>_symmetric
  FfiEntry cuda_symmetric;  // its CUDA entry, marked command-buffer compatible (ffi/handler.h); nullptr without CUDA
  FfiEntry cuda_symmetric_initialize;  // and that entry's initialize stage
};

const std::vector<TargetEntries>& Targets();

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_FFI_TARGETS_H_
