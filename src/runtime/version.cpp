#include "fsdp/version.h"

namespace fsdp {

const char* version() { return FSDP_VERSION_STRING; }

}  // namespace fsdp
