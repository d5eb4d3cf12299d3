#include "device/backends.h"
#include "device/dma.h"

namespace ficco {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CallContext& ctx) : ctx_(ctx) {}

  ffi::Error Prepare(int, const std::vector<int>&) override { return ffi::Error::Success(); }
  ffi::Error Record(int, Event* event) override {
    *event = nullptr;
    return ffi::Error::Success();
  }
  ffi::Error Wait(int, Event) override { return ffi::Error::Success(); }
  ffi::Error Copy(int, void* dst, const void* src, size_t bytes) override {
    CopyChunkHost(dst, src, bytes);
    return ffi::Error::Success();
  }
  ffi::Error Gemm(const GemmProblem& problem) override {
    GemmHost(problem);
    return ffi::Error::Success();
  }
  ffi::Error Reduce(const ReduceProblem& problem) override {
    ReduceSumHost(problem);
    return ffi::Error::Success();
  }
  void ReleaseEvents() override {}

 private:
  CallContext ctx_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(const CallContext& ctx) { return std::make_unique<CpuBackend>(ctx); }

}  // namespace ficco
