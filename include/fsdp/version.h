// fsdp.cpp's version (e.g. "0.6.0"): the project's CMake version, also recorded in every
// checkpoint's metadata and printed by `fsdp-train --version`. CHANGELOG.md says what changed.
#pragma once

namespace fsdp {

const char* version();

}  // namespace fsdp
