// One handler definition serves every target on CPU and CUDA: a Target names the target, its Impl,
// its attribute struct and its operands (Arg: an input buffer, Ret: a result buffer, in binding
// order), and yields both platforms' XLA FFI entry points. Every call's first operand is its
// position (XLA's partition id) and every target has an instantiate stage, whose state (a Placement,
// one per compiled executable) keeps the group each device resolved from its position at its first
// call (runtime/placement.h). Each entry checks the call's contract version (ffi/contract.h),
// decodes the attributes into an OpConfig (once), makes the platform's Backend (passed through the
// registry's one test hook, Registry::Wrap: testing/faults.h) and runs the Impl behind Guard
// (base/guard.h): no exception or CUDA error escapes.
//
// Every call is watched (runtime/watchdog.h) from its start until its device work is done. A call
// that fails also writes its error to stderr: JAX raises it only once every device's part of the
// program has finished, which a peer stuck in a collective of XLA's own may never do.
//
// The entries are not marked command-buffer compatible: a call that meets its group must meet at
// every execution, and every call registers its watch and counts its calls on the host (a channel's
// words hold per-call values), all of which a captured CUDA graph would skip. Each target has a
// second CUDA entry that is, for the calls of transfer=symmetric (the lowering names the target
// <name>_symmetric): they meet nobody after their site's first call, their devices count and compare
// everything (runtime/symmetric.h), and the watchdog reads what the devices post, so a replay without
// the handler runs as a call would. XLA calls such a handler under stream capture whenever it
// records the call again (its buffers moved); device/gemm.h and CaptureRelaxed say what then differs.
// That entry has an initialize stage too, which numbers the launches (runtime/symmetric.h, "Launches").
#ifndef FICCO_JAX_XLA_FFI_FFI_HANDLER_H_
#define FICCO_JAX_XLA_FFI_FFI_HANDLER_H_

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/guard.h"
#include "base/timed.h"
#include "device/backends.h"
#include "ffi/attrs.h"
#include "ffi/contract.h"
#include "runtime/registry.h"
#include "runtime/watchdog.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ficco {

// An input buffer of the target.
struct Arg {
  using Type = ffi::AnyBuffer;
  static ffi::AnyBuffer Get(Type buffer) { return buffer; }
  template <typename Binding>
  static auto Bind(Binding&& binding) { return std::move(binding).template Arg<ffi::AnyBuffer>(); }
};

// A result buffer of the target.
struct Ret {
  using Type = ffi::Result<ffi::AnyBuffer>;
  static ffi::AnyBuffer Get(Type buffer) { return *buffer; }
  template <typename Binding>
  static auto Bind(Binding&& binding) { return std::move(binding).template Ret<ffi::AnyBuffer>(); }
};

// The attribute struct, bound last.
template <typename Attrs>
struct AttrsOf {
  template <typename Binding>
  static auto Bind(Binding&& binding) { return std::move(binding).template Attrs<Attrs>(); }
};

// Binds Steps... in order. XLA's bindings cannot be moved or copied: every step takes the previous
// one as a temporary and returns the next as one.
template <typename First, typename... Rest>
struct BindSteps {
  template <typename Binding>
  static auto To(Binding&& binding) {
    if constexpr (sizeof...(Rest) == 0) {
      return First::Bind(std::move(binding));
    } else {
      return BindSteps<Rest...>::To(First::Bind(std::move(binding)));
    }
  }
};

// A call's position operand (runtime/placement.h): XLA's partition id, a u32 scalar.
inline ffi::Error CheckPositionOperand(const CallContext& ctx, ffi::AnyBuffer position) {
  if (position.element_type() != ffi::DataType::U32 || position.size_bytes() != sizeof(uint32_t)) {
    return MakeInvalid(ctx, "operand 0 must be the call's position (a u32 partition id), found " +
                                std::to_string(position.size_bytes()) + " bytes of dtype " +
                                std::to_string(static_cast<int>(position.element_type())) +
                                "; the program was lowered by another version of ficco_jax: lower it again");
  }
  return ffi::Error::Success();
}

// The CPU platform: synchronous backend; handlers sleep at once in a rendezvous.
struct CpuPlatform {
  static constexpr double kSpinSeconds = 0.0;
  // XLA's CPU runtime has no initialize stage: a symmetric call numbers its launch itself.
  static constexpr bool kLaunchFromRun = true;
  std::unique_ptr<Backend> MakeBackend(const OpConfig& config) const {
    return MakeCpuBackend(config.ctx, Registry::Get().host_events(), config.timeout_s);
  }
  // The position operand is in host memory.
  PositionReader Position(const CallContext& ctx, ffi::AnyBuffer position) const {
    return [&ctx, position](int64_t* out) -> ffi::Error {
      FICCO_RETURN_IF_ERROR(CheckPositionOperand(ctx, position));
      *out = *static_cast<const uint32_t*>(position.untyped_data());
      return ffi::Error::Success();
    };
  }
};

#ifdef FICCO_WITH_CUDA
// The CUDA platform: XLA's stream is the compute stream. GPU peers reach a rendezvous within
// microseconds of each other: handlers spin this long before sleeping (see Arrival::spin_s).
struct CudaPlatform {
  static constexpr double kSpinSeconds = 100e-6;
  static constexpr bool kLaunchFromRun = false;  // the initialize stage counts launches
  cudaStream_t stream;
  std::unique_ptr<Backend> MakeBackend(const OpConfig& config) const {
    // A group across processes records interprocess events: peers in other processes wait on them
    // (not on a symmetric call's: its peers read the site's words).
    return MakeCudaBackend(config.ctx, Registry::Get().Device(config.ctx.device_ordinal).cuda(), stream,
                           /*interprocess_events=*/config.cross_process() && !config.symmetric);
  }
  // The position operand is in device memory, written by XLA's stream: one copy to the host, waited
  // for, at the first call of each device under an executable (the Placement keeps the result). A
  // command buffer records its calls after a first execution without capture, so this never runs
  // while XLA captures; were it to, the call says so rather than read a value not yet written.
  PositionReader Position(const CallContext& ctx, ffi::AnyBuffer position) const {
    return [&ctx, position, stream = stream](int64_t* out) -> ffi::Error {
      FICCO_RETURN_IF_ERROR(CheckPositionOperand(ctx, position));
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      FICCO_CHECK_CUDA(cudaStreamIsCapturing(stream, &capturing));
      if (capturing != cudaStreamCaptureStatusNone) {
        return MakeError(ctx, "the first call of this op under its device assignment is being captured into a "
                              "command buffer, before it could learn its group; run the program once without "
                              "command buffers first");
      }
      uint32_t value = 0;
      FICCO_CHECK_CUDA(cudaMemcpyAsync(&value, position.untyped_data(), sizeof(value), cudaMemcpyDeviceToHost, stream));
      FICCO_CHECK_CUDA(cudaStreamSynchronize(stream));
      *out = value;
      return ffi::Error::Success();
    };
  }
};
#endif

template <const char* kName, auto kImpl, typename Attrs, typename... Operands>
struct Target {
  static constexpr const char* name = kName;

  static ffi::Error OnCpu(int32_t ordinal, ffi::RunId run, Placement* placement, ffi::AnyBuffer position,
                          typename Operands::Type... operands, Attrs attrs) {
    return Run(CpuPlatform{}, ordinal, run, placement, position, attrs, Operands::Get(operands)...);
  }
  static XLA_FFI_Error* CpuEntry(XLA_FFI_CallFrame* frame) {
    if (XLA_FFI_Error* refused = CheckContract(frame, kName)) return refused;
    static auto* handler = BindSteps<Operands..., AttrsOf<Attrs>>::To(ffi::Ffi::Bind()
                                                                          .Ctx<ffi::DeviceOrdinal>()
                                                                          .Ctx<ffi::RunId>()
                                                                          .Ctx<ffi::State<Placement>>()
                                                                          .Arg<ffi::AnyBuffer>())
                               .To(OnCpu)
                               .release();
    return handler->Call(frame);
  }
  // The instantiate stage, once per compiled executable: the Placement its calls keep their groups in
  // (runtime/placement.h). The state is set here by hand rather than returned: a stage that returns
  // its state declares the state's type when XLA registers the handler, and jaxlib registers the types
  // it holds back for a backend not yet started after the handlers it holds back, then refuses them
  // (ficco_jax is imported before jax starts its backends). By the time XLA instantiates a call, the
  // type is registered.
  static XLA_FFI_Error* Instantiate(XLA_FFI_CallFrame* frame) {
    static auto* checked = ffi::Ffi::BindInstantiate().To([] { return ffi::Error::Success(); }).release();
    if (XLA_FFI_Error* error = checked->Call(frame)) return error;
    if (frame->extension_start != nullptr && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
      return nullptr;  // registration asked for the metadata, which `checked` wrote
    }
    auto placement = std::make_unique<Placement>();
    XLA_FFI_State_Set_Args args;
    args.struct_size = XLA_FFI_State_Set_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.ctx = frame->ctx;
    args.stage = XLA_FFI_ExecutionStage_INSTANTIATE;
    args.type_id = &Placement::id;
    args.state = placement.get();
    XLA_FFI_Error* error = frame->api->XLA_FFI_State_Set(&args);
    if (error == nullptr) placement.release();  // XLA owns it now (the type's deleter frees it)
    return error;
  }

#ifdef FICCO_WITH_CUDA
  static ffi::Error OnCuda(cudaStream_t stream, int32_t ordinal, ffi::RunId run, Placement* placement,
                           ffi::AnyBuffer position, typename Operands::Type... operands, Attrs attrs) {
    return Run(CudaPlatform{stream}, ordinal, run, placement, position, attrs, Operands::Get(operands)...);
  }
  static auto CudaBinding() {
    return BindSteps<Operands..., AttrsOf<Attrs>>::To(ffi::Ffi::Bind()
                                                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                          .Ctx<ffi::DeviceOrdinal>()
                                                          .Ctx<ffi::RunId>()
                                                          .Ctx<ffi::State<Placement>>()
                                                          .Arg<ffi::AnyBuffer>());
  }
  static XLA_FFI_Error* CudaEntry(XLA_FFI_CallFrame* frame) {
    if (XLA_FFI_Error* refused = CheckContract(frame, kName)) return refused;
    static auto* handler = CudaBinding().To(OnCuda).release();
    return handler->Call(frame);
  }
  // The same handler, marked command-buffer compatible: for transfer=symmetric calls only.
  static XLA_FFI_Error* CudaSymmetricEntry(XLA_FFI_CallFrame* frame) {
    if (XLA_FFI_Error* refused = CheckContract(frame, kName)) return refused;
    static auto* handler = CudaBinding().To(OnCuda, {ffi::Traits::kCmdBufferCompatible}).release();
    return handler->Call(frame);
  }
  // Its initialize stage, which XLA runs at every launch before any thunk executes, outside command
  // buffers: counts the launch on the launch word of the op and this device's group
  // (runtime/symmetric.h, "Launches"). The group is the one this executable's first call on the
  // device resolved (runtime/placement.h): before that call nothing is counted, on every member alike,
  // so the members' numbers still agree. It runs for every op of every launch, so it decodes only the
  // attributes it needs (the execute stage checks the rest). No run id: not every XLA hands one to
  // this stage.
  static ffi::Error InitializeOnCuda(cudaStream_t stream, int32_t ordinal, Placement* placement,
                                     ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary attrs) {
    const ffi::ErrorOr<int64_t> n = attrs.get<int64_t>("group_size");
    if (n.has_value() && *n < 2) return ffi::Error::Success();
    const ffi::ErrorOr<int64_t> op_id = attrs.get<int64_t>("op_id");
    if (!n.has_value() || !op_id.has_value()) {
      return ffi::Error::InvalidArgument(std::string(kName) + ": an attribute that names its group is missing");
    }
    const std::optional<ResolvedGroup> group = placement->Find(ordinal);
    if (!group.has_value()) return ffi::Error::Success();
    return Guard(kName, [&]() -> ffi::Error {
      const CallContext ctx{kName, *op_id, ordinal};
      std::unique_ptr<Backend> backend = MakeCudaBackend(ctx, Registry::Get().Device(ordinal).cuda(), stream,
                                                         /*interprocess_events=*/false);
      return Registry::Get().symmetric().CountLaunch(*backend, {*op_id, ordinal, group->group});
    });
  }
  static XLA_FFI_Error* CudaSymmetricInitialize(XLA_FFI_CallFrame* frame) {
    static auto* handler = ffi::Ffi::BindInitialize()
                               .Ctx<ffi::PlatformStream<cudaStream_t>>()
                               .Ctx<ffi::DeviceOrdinal>()
                               .Ctx<ffi::State<Placement>>()
                               .RemainingArgs()
                               .RemainingRets()
                               .Attrs()
                               .To(InitializeOnCuda)
                               .release();
    return handler->Call(frame);
  }
#endif

 private:
  template <typename Platform, typename... Buffers>
  static ffi::Error Run(const Platform& platform, int32_t ordinal, ffi::RunId run, Placement* placement,
                        ffi::AnyBuffer position, const Attrs& attrs, Buffers... buffers) {
    const TimeSection timed(Registry::Get().handlers());
    return Guard(kName, [&]() -> ffi::Error {
      OpConfig config;
      config.spin_s = Platform::kSpinSeconds;
      const CallContext ctx{kName, ScheduleAttrs(attrs).op_id, ordinal};
      FICCO_RETURN_IF_ERROR(DecodeConfig(ScheduleAttrs(attrs), kName, ordinal, run.run_id,
                                         platform.Position(ctx, position), placement, &config));
      config.launch_from_run = Platform::kLaunchFromRun;
      std::unique_ptr<Backend> backend = CountCalls(platform.MakeBackend(config));
      if constexpr (std::is_same_v<Attrs, OpAttrs>) {  // a test's armed fault (none in a measurement)
        backend = Registry::Get().Wrap(std::move(backend), config);
      }
      // A symmetric call's site is watched instead (runtime/symmetric.h): a replayed call registers nothing.
      std::optional<CallWatch> watch;
      if (!config.symmetric) {
        watch.emplace(*backend, config);
        config.watch = &*watch;
      }
      // Something thrown inside the op is its error too: the watch and the channel below still hear of it.
      ffi::Error result = Guard(kName, [&]() -> ffi::Error {
        if constexpr (std::is_same_v<Attrs, OpAttrs>) {
          return kImpl(*backend, config, buffers...);
        } else {
          return kImpl(*backend, config, attrs, buffers...);
        }
      });
      if (watch) watch->Finish(*backend);
      if (result.failure()) {
        std::fprintf(stderr, "%s\n", result.message().c_str());
        // Its peers may wait for words this call never set: the group starts over on a new generation
        // of its channel (runtime/channel.h). (A symmetric call stops its site itself where it failed
        // after counting itself: exec/, FailSymmetric.)
        Channel* channel = config.cross_process() ? nullptr : Registry::Get().channels().Find(config.group);
        if (channel != nullptr) channel->Retire(config.run_id, config.rank, result.message());
      }
      return result;
    });
  }
};

}  // namespace ficco

#endif  // FICCO_JAX_XLA_FFI_FFI_HANDLER_H_
