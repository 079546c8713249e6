// fsdp.cpp: fully sharded data parallel training for libtorch. This header includes the whole
// public API; each part below is a header of its own (docs/guide.md walks the user's path).
#pragma once

// Training a torch::nn model: join the ranks, shard its modules, call them, save and resume.
#include "fsdp/launch.h"              // init(): ranks, devices and the communicator from the launcher
#include "fsdp/mesh.h"                // HSDP: replicas x shards (x tp)
#include "fsdp/tensor_parallel.h"     // layers split over the tp ranks: parts, tp collectives
#include "fsdp/options.h"             // per-module options: reshard_after_forward, mixed precision, offload
#include "fsdp/fully_shard.h"         // fully_shard() a module; fsdp::forward() through it
#include "fsdp/recompute.h"           // recompute a module's forward in backward
#include "fsdp/float8.h"              // float8 linears and float8 all-gather
#include "fsdp/runtime_options.h"     // process-wide scheduling knobs and what the runtime counted
#include "fsdp/sharded_checkpoint.h"  // every rank saves and loads its own rows
#include "fsdp/version.h"

// Writing a front end (the Python package is one): the module-agnostic groups under fully_shard.
#include "fsdp/group.h"
#include "fsdp/communicator.h"        // collectives between the ranks of a communicator

// Planning under a memory budget: profile a step, choose a schedule, apply it.
#include "fsdp/planning.h"
