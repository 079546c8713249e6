// HSDP (hybrid sharding): a 2-D layout of the ranks, replicas x shards (and with tensor
// parallelism a third dimension, tp, innermost: docs/parallelism.md). Each replica is a group of
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

/// A rank's communicators under HSDP and tensor parallelism (make_mesh).
struct Mesh {
  std::shared_ptr<Communicator> shard;      ///< this rank's replica: ranks holding different shards
  std::shared_ptr<Communicator> replicate;  ///< the ranks holding this rank's shard, one per replica
  /// The ranks that split each layer with this one (tensor parallelism); null where tp = 1.
  std::shared_ptr<Communicator> tp;
  /// With tp > 1: this rank's replica, shards x tp ranks that hold the model once between them
  /// (they save it); null where tp = 1 (then `shard` is the replica).
  std::shared_ptr<Communicator> replica;
  int replicas() const { return replicate->world_size(); }  ///< how many copies of the model
};

/// Collective over `world` (default: the communicator init() made), laid out as
/// init_device_mesh lays out (replicas, shards, tp): rank r = (replica * shards + shard) * tp + t.
/// `shard` joins the ranks of one replica with the same tp index t (each holds its tp part's
/// rows), `replicate` those with the same shard and t, `tp` those with the same replica and shard.
/// Throws std::invalid_argument when replicas * tp does not divide the world size. replicas = 1
/// and tp = 1 is plain FSDP; replicas = world plain data parallelism (every rank holds
/// everything; the reduce-scatter becomes a copy).
Mesh make_mesh(int replicas, std::shared_ptr<Communicator> world = nullptr, int tp = 1);

}  // namespace fsdp
