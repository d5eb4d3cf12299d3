// `ficco_jax._ffi.testing`: the extension's test-only entry points, which the library never calls.
#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/map.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "device/backends.h"
#include "runtime/channel.h"
#include "runtime/ipc_mailbox.h"
#include "runtime/registry.h"
#include "testing/faults.h"

namespace ficco {
namespace {

namespace nb = nanobind;

void InjectFault(const std::string& spec) {
  std::optional<InjectedFault> fault;
  if (!ParseFault(spec, &fault)) {
    throw std::invalid_argument("inject_fault('" + spec +
                                "'): expected '' (no fault), 'skip:<rank>', 'fail:<rank>', 'fail:<rank>:<k>' (k >= 1) "
                                "or 'stall:<rank>'");
  }
  ArmFault(fault);
}

// A channel generation's host check that the ranks run the same op at each call
// (ChannelGeneration::CheckSignature), without devices: for each (rank, call, signature) in order,
// the first rank whose note of that call differs, or -1.
std::vector<int> ChannelSignatureChecks(int n, const std::vector<std::tuple<int, uint32_t, std::vector<int64_t>>>& notes) {
  ChannelGeneration generation(0, 0, std::vector<char*>(n, nullptr), nullptr);
  std::vector<int> differs;
  for (const auto& [rank, call, signature] : notes) {
    if (rank < 0 || rank >= n) throw std::invalid_argument("rank " + std::to_string(rank) + " is not in 0 .. n-1");
    differs.push_back(generation.CheckSignature(rank, call, SignatureHash(signature)));
  }
  return differs;
}

// The host mailbox's exchange with plain integers, for tests of its protocol across processes
// (tests/test_ipc_mailbox.py): every rank calls it once per post with its tag (op_id, phase, call,
// run_id) and fields; returns every rank's (op_id, signature, buffer_export, buffer_offset,
// event_ids) or raises RuntimeError. `call` 0 takes the rank's next call ordinal (NextCall).
using WireTuple = std::tuple<int64_t, std::vector<int64_t>, int64_t, int64_t, std::vector<int32_t>>;
std::vector<WireTuple> MailboxExchange(int64_t job, std::vector<int> members, int rank, int64_t op_id,
                                       std::vector<int64_t> signature, int64_t buffer_export, int64_t buffer_offset,
                                       std::vector<int32_t> event_ids, double timeout_s, int32_t phase, uint64_t call,
                                       int64_t run_id) {
  CallContext ctx{"mailbox_test", op_id, rank};
  WirePost mine;
  mine.op_id = op_id;
  mine.phase = phase;
  mine.call = call;
  mine.run_id = run_id;
  mine.signature = std::move(signature);
  mine.buffer_export = buffer_export;
  mine.buffer_offset = buffer_offset;
  mine.event_ids = std::move(event_ids);
  mine.raw_events.assign(mine.event_ids.size(), 0);
  std::vector<WirePost> posts;
  ffi::Error error = ffi::Error::Success();
  {
    nb::gil_scoped_release release;
    HostMailbox* mailbox = nullptr;
    error = Registry::Get().Mailbox(ctx, job, &mailbox);
    MailboxArrival who{&ctx, &members, rank, "test", timeout_s};
    if (error.success() && mine.call == 0) error = mailbox->NextCall(who, &mine.call);
    if (error.success()) error = mailbox->Exchange(who, mine, &posts);
  }
  if (error.failure()) throw std::runtime_error(error.message());
  std::vector<WireTuple> out;
  for (const WirePost& p : posts) {
    out.emplace_back(p.op_id, p.signature, p.buffer_export, p.buffer_offset, p.event_ids);
  }
  return out;
}

// One arrival at the in-process rendezvous with plain integers, for tests of its checks: rank `rank`
// of a group of `group_size` (ordinals 0 ..) at key (run_id, op_id, 0, exchange, 0). Raises
// RuntimeError with the rendezvous's error.
void RendezvousArrive(int64_t run_id, int64_t op_id, int group_size, int rank, double timeout_s) {
  const CallContext ctx{"rendezvous_test", op_id, rank};
  std::vector<int> group(std::max(group_size, 0));
  for (int i = 0; i < group_size; ++i) group[i] = i;
  const RendezvousKey key{run_id, op_id, 0, Phase::kExchange, 0};
  std::vector<Post> posts;
  ffi::Error error = ffi::Error::Success();
  {
    nb::gil_scoped_release release;
    error = Registry::Get().rendezvous().Arrive(key, Arrival{&ctx, &group, rank, timeout_s}, Post{}, &posts);
  }
  if (error.failure()) throw std::runtime_error(error.message());
}

// How many events the pool of one device has made: the CPU devices' shared pool (ordinal -1), or
// a GPU's (CUDA builds).
int64_t EventsMade(int ordinal) {
  if (ordinal < 0) return Registry::Get().host_events().Made();
#ifdef FICCO_WITH_CUDA
  return Registry::Get().Device(ordinal).cuda().Made();
#else
  throw std::invalid_argument("events_made(" + std::to_string(ordinal) + "): this build has no CUDA backend");
#endif
}

// How many of those events are back in the pool, free to reuse (same ordinals as EventsMade).
int64_t EventsFree(int ordinal) {
  if (ordinal < 0) return Registry::Get().host_events().Free();
#ifdef FICCO_WITH_CUDA
  return Registry::Get().Device(ordinal).cuda().Free();
#else
  throw std::invalid_argument("events_free(" + std::to_string(ordinal) + "): this build has no CUDA backend");
#endif
}

}  // namespace

void DefineTestingModule(nb::module_& m) {
  nb::module_ testing = m.def_submodule("testing", "Test-only entry points; the library never calls them.");
  testing.def("inject_fault", &InjectFault, nb::arg("spec"),
              "Arms a fault for every later copy-engine call of this process until the next call of this "
              "function: 'skip:<rank>' (that rank of every group fails before it meets its peers), "
              "'fail:<rank>' (it joins the exchange, then fails at its first transfer), 'fail:<rank>:<k>' (the "
              "same at its k-th operation on a copy stream), 'stall:<rank>' (the events it records on XLA's "
              "stream never complete; only the watchdog ends the process), or '' (none). "
              "xla_ffi/testing/faults.h.");
  testing.def("unjoined_copy_calls", &UnjoinedCopyCalls,
              "How many calls of an armed rank returned, failed or not, while a copy they enqueued was not yet "
              "waited for by XLA's stream (0 unless the executor breaks that rule).");
  testing.def("host_meetings", [] { return Registry::Get().rendezvous().meetings().Calls(); },
              "How many times a rank of an in-process group has waited for its group on the host so far.");
  testing.def("host_time",
              [] {
                const TimedCount& handlers = Registry::Get().handlers();
                return std::map<std::string, double>{
                    {"calls", static_cast<double>(handlers.Calls())},
                    {"handler_s", handlers.Ns() * 1e-9},
                    {"meeting_s", Registry::Get().rendezvous().meetings().Ns() * 1e-9},
                    {"channel_waits", static_cast<double>(Registry::Get().channel_waits().Calls())},
                    {"channel_wait_s", Registry::Get().channel_waits().Ns() * 1e-9}};
              },
              "Host time of the copy-engine handlers of this process so far: how many ran ('calls'), their "
              "seconds from start to return ('handler_s'), and of those the seconds spent in host meetings "
              "with their peers ('meeting_s', waiting for a late peer included) and, on group channels, how "
              "often and how long they waited for a peer's host to enqueue its writes ('channel_waits', "
              "'channel_wait_s'), summed over every device.");
  testing.def("events_made", &EventsMade, nb::arg("ordinal") = -1,
              "How many events the pool of a device has made so far: -1 for the CPU devices' shared pool, "
              "else a GPU's ordinal. It stays bounded while calls give their events back.");
  testing.def("events_free", &EventsFree, nb::arg("ordinal") = -1,
              "How many of the events events_made() counts are in the pool now, free to reuse: the others "
              "belong to calls in flight, to finished calls the watchdog has not swept yet, or, for good, to "
              "failed calls.");
  testing.def("watched_calls", [] { return Registry::Get().watchdog().Watched(); },
              "How many copy-engine calls of this process the watchdog watches: 0 once it has swept every "
              "call, and then every finished call's events are back in their pool (events_free), except "
              "those held for a group whose peer failed before releasing them.");
  testing.def("backend_calls",
              [] {
                const BackendCalls c = BackendCallTotals();
                std::map<std::string, double> out;
                for (const auto& [name, kind] : {std::pair{"record", c.record}, std::pair{"mark", c.mark},
                                                 std::pair{"wait", c.wait}, std::pair{"copy", c.copy},
                                                 std::pair{"gemm", c.gemm}, std::pair{"reduce", c.reduce},
                                                 std::pair{"set_word", c.set_word},
                                                 std::pair{"wait_word", c.wait_word},
                                                 std::pair{"counter", c.counter}}) {
                  out[name] = static_cast<double>(kind.calls);
                  out[std::string(name) + "_s"] = kind.ns * 1e-9;
                }
                return out;
              },
              "How many events the backends of this process recorded ('record'; 'mark': the watchdog's marks "
              "of a call's start and end) and waited for, how many copies, matmuls and sums they issued, and "
              "how many channel words they set and waited for ('set_word', 'wait_word') and how many counters "
              "of symmetric calls they counted, waited for and posted ('counter'), so far, each with its host "
              "seconds ('<name>_s'): on CUDA the driver calls a call makes, on CPU the whole work.");
  testing.def("channel_signature_checks", &ChannelSignatureChecks, nb::arg("n"), nb::arg("notes"),
              "A group channel's check that the ranks of a group of n run the same op at each call, made "
              "without devices: for each (rank, call, signature) in `notes`, in order, the first rank whose "
              "note of that call differs, or -1.");
  testing.def("mailbox_layout", [] { return MailboxLayoutForTests(); },
              "Byte offsets in the host mailbox's segment (rank 1 of group entry 0 and its odd post's "
              "fields), for tests that write a corrupt post as another process could.");
  testing.def("rendezvous_arrive", &RendezvousArrive, nb::arg("run_id"), nb::arg("op_id"), nb::arg("group_size"),
              nb::arg("rank"), nb::arg("timeout_s"),
              "One arrival of rank `rank` of a group of `group_size` at the in-process rendezvous key (run_id, "
              "op_id); returns once the group met, raises RuntimeError with its error.");
  testing.def("mailbox_exchange", &MailboxExchange, nb::arg("job"), nb::arg("members"), nb::arg("rank"),
              nb::arg("op_id"), nb::arg("signature"), nb::arg("buffer_export"), nb::arg("buffer_offset"),
              nb::arg("event_ids"), nb::arg("timeout_s"), nb::arg("phase") = 0, nb::arg("call") = 0,
              nb::arg("run_id") = 0,
              "One post through the host mailbox (groups across processes) with plain integers; returns every "
              "rank's (op_id, signature, buffer_export, buffer_offset, event_ids).");
}

}  // namespace ficco
