#include "device/reduce.h"

namespace ficco {

void ReduceSumHost(const ReduceProblem& p) {
  for (int64_t i = 0; i < p.count; ++i) {
    float sum = LoadAsFloat(p.own, i, p.dtype);
    for (int64_t s = 0; s < p.num_slots; ++s) sum += LoadAsFloat(p.recv, s * p.slot_stride + i, p.dtype);
    StoreFromFloat(p.out, i, p.dtype, sum);
  }
}

}  // namespace ficco
