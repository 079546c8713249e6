// The trainer's usage errors, in a header of their own so that a small reader (train/config_file.cpp)
// raises them without the command line's dependencies.
#pragma once

#include <stdexcept>

namespace fsdp::train {

// Bad flags or a run this machine cannot do: the user's to fix, reported without a backtrace.
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace fsdp::train
