// Text for error messages without iostreams. On the GPU machine an error message built with
// std::ostringstream (`stream << int64_t`) crashed the process with SIGSEGV inside
// std::ostream::_M_insert<long> (native stack from FICCO_SEGV_TRACE=1, 4 x H200, jax 0.11.2):
// every path that formats numbers uses std::to_string / snprintf (the C library) instead.
#ifndef FICCO_JAX_XLA_FFI_BASE_TEXT_H_
#define FICCO_JAX_XLA_FFI_BASE_TEXT_H_

#include <cstdint>
#include <cstdio>
#include <string>

namespace ficco {

// "a, b, c" for any container of integers.
template <typename Container>
std::string JoinNumbers(const Container& values) {
  std::string out;
  bool first = true;
  for (const auto& v : values) {
    if (!first) out += ", ";
    out += std::to_string(v);
    first = false;
  }
  return out;
}

// A double as printf's %g (e.g. seconds in a timeout message).
inline std::string ShortNumber(double value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", value);
  return buf;
}

inline std::string Hex(uint64_t value) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(value));
  return buf;
}

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_BASE_TEXT_H_
