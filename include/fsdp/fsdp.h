// fsdp.cpp: fully sharded data parallel training for libtorch.
#pragma once

#include "fsdp/recompute.h"
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/communicator.h"
#include "fsdp/float8.h"
#include "fsdp/fully_shard.h"
#include "fsdp/launch.h"
#include "fsdp/mesh.h"
#include "fsdp/options.h"
#include "fsdp/planning.h"
#include "fsdp/runtime_options.h"
#include "fsdp/unit.h"
#include "fsdp/version.h"
