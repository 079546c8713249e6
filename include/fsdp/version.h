// fsdp.cpp's version ("0.4.0"): the project's CMake version, also recorded in every checkpoint's
// metadata. CHANGELOG.md says what changed.
#pragma once

namespace fsdp {

const char* version();

}  // namespace fsdp
