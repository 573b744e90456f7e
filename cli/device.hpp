// --device for the subcommands: where the operator runs. The CLI holds its
// tensors in host memory (files in, files out); on a CUDA device a call is
// staged through device copies and its results copied back.
#pragma once

#include <string>

#include "kvcomp/kvcomp.hpp"

namespace kvcomp::cli {

// "cpu", "cuda" (device 0) or "cuda:N"; false for anything else.
bool parse_device(const std::string& text, Device* out);

// Runs the call on `device` and leaves every output in the Args' host
// memory. *ms: the call alone, including its device work (not the copies).
Status run_on(Device device, ForwardArgs a, const Options& o, double* ms);
Status run_on(Device device, BackwardArgs a, const Options& o, double* ms);

// A timed loop of the same call on `device` (copies made once, outside the
// timing): f(args) is called `repeat` times; *best and *total in seconds.
Status time_on(Device device, ForwardArgs a, const Options& o, int repeat, double* best, double* total);
Status time_on(Device device, BackwardArgs a, const Options& o, int repeat, double* best, double* total);

}  // namespace kvcomp::cli
