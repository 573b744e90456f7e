#include "device.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#ifdef KVCOMP_HAVE_CUDA
#include "cuda/staging.hpp"
#endif

namespace kvcomp::cli {

namespace {

using Clock = std::chrono::steady_clock;

Status call(const ForwardArgs& a, const Options& o) { return compressor_forward(a, o); }
Status call(const BackwardArgs& a, const Options& o) { return compressor_backward(a, o); }

template <typename Args>
Status timed(Device device, Args a, const Options& o, int repeat, double* best, double* total, bool keep) {
  *best = 1e300;
  *total = 0;
#ifdef KVCOMP_HAVE_CUDA
  std::unique_ptr<staging::DeviceCopies> copies;
  if (device.type == DeviceType::cuda && device.index >= cuda_device_count())
    return {StatusCode::invalid_param, "[kvcomp] --device (= " + device_name(device) +
                                           ") must be a CUDA device of this machine (it has " +
                                           std::to_string(cuda_device_count()) + ")"};
  if (device.type == DeviceType::cuda) {
    copies = std::make_unique<staging::DeviceCopies>(device);
    if (auto s = copies->stage(a); !s.ok()) return s;
  }
#else
  if (device.type == DeviceType::cuda)
    return {StatusCode::invalid_param,
            "[kvcomp] --device (= " + device_name(device) +
                ") must be cpu: this build of kvcomp has no CUDA backend (configure "
                "it with -DKVCOMP_CUDA=ON and a CUDA 13 toolkit)"};
#endif
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    Status s = call(a, o);
#ifdef KVCOMP_HAVE_CUDA
    if (s.ok() && copies) s = copies->synchronize();  // the device work belongs to the call's time
#endif
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!s.ok()) return s;
    *best = std::min(*best, t);
    *total += t;
  }
#ifdef KVCOMP_HAVE_CUDA
  if (keep && copies) return copies->copy_back();
#else
  (void)keep;
#endif
  return Status::success();
}

}  // namespace

bool parse_device(const std::string& text, Device* out) {
  if (text == "cpu") {
    *out = {};
    return true;
  }
  if (text == "cuda") {
    *out = {DeviceType::cuda, 0};
    return true;
  }
  if (text.rfind("cuda:", 0) != 0 || text.size() == 5 || text.size() > 9) return false;
  int index = 0;
  for (char ch : text.substr(5)) {
    if (ch < '0' || ch > '9') return false;
    index = index * 10 + (ch - '0');
  }
  *out = {DeviceType::cuda, index};
  return true;
}

Status run_on(Device device, ForwardArgs a, const Options& o, double* ms) {
  double best = 0, total = 0;
  const Status s = timed(device, a, o, 1, &best, &total, true);
  *ms = best * 1e3;
  return s;
}

Status run_on(Device device, BackwardArgs a, const Options& o, double* ms) {
  double best = 0, total = 0;
  const Status s = timed(device, a, o, 1, &best, &total, true);
  *ms = best * 1e3;
  return s;
}

Status time_on(Device device, ForwardArgs a, const Options& o, int repeat, double* best, double* total) {
  return timed(device, a, o, repeat, best, total, false);
}

Status time_on(Device device, BackwardArgs a, const Options& o, int repeat, double* best, double* total) {
  return timed(device, a, o, repeat, best, total, false);
}

}  // namespace kvcomp::cli
