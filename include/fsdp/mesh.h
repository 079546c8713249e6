// HSDP (hybrid sharding): a 2-D layout of the ranks, replicas x shards. Each replica is a group of
// consecutive ranks that shards the model among themselves (ZeRO-3 within the group); the groups
// hold identical copies. After a group's gradients are reduce-scattered within its replica, they
// are averaged over the ranks holding the same shard in the other replicas.
//
//   fsdp::init();
//   fsdp::Mesh mesh = fsdp::make_mesh(/*replicas=*/2);    // 8 ranks: 2 replicas of 4
//   fsdp::ShardOptions o;
//   o.comm = mesh.shard;
//   o.replicate = mesh.replicate;
//   for (auto& block : model->blocks) fsdp::fully_shard(block, o);
//   fsdp::fully_shard(model, o);
//
// Memory: each rank holds 1/shards of the sharded state (not 1/world); all-gathers and
// reduce-scatters run among a replica's ranks (on one host, over its fastest links), the added
// all-reduce moves each rank's shard of the gradients across replicas.
#pragma once

#include <memory>

#include "fsdp/communicator.h"

namespace fsdp {

/// The two communicators of a rank under HSDP (make_mesh).
struct Mesh {
  std::shared_ptr<Communicator> shard;      ///< this rank's replica: ranks holding different shards
  std::shared_ptr<Communicator> replicate;  ///< the ranks holding this rank's shard, one per replica
  int replicas() const { return replicate->world_size(); }  ///< how many copies of the model
};

/// Collective over `world` (default: the communicator init() made): rank r belongs to replica
/// r / (world / replicas) and holds shard r % (world / replicas). Throws std::invalid_argument
/// when `replicas` does not divide the world size. replicas = 1 is plain FSDP, replicas = world
/// plain data parallelism (every rank holds everything; the reduce-scatter becomes a copy).
Mesh make_mesh(int replicas, std::shared_ptr<Communicator> world = nullptr);

}  // namespace fsdp
