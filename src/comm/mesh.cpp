#include "fsdp/mesh.h"

#include <stdexcept>
#include <string>

#include "fsdp/launch.h"

namespace fsdp {

Mesh make_mesh(int replicas, std::shared_ptr<Communicator> world, int tp) {
  if (!world) world = default_communicator();
  const int size = world->world_size();
  if (replicas < 1 || tp < 1 || size % (replicas * tp) != 0)
    throw std::invalid_argument("fsdp::make_mesh: " + std::to_string(replicas) + " replicas" +
                                (tp > 1 ? " x tp " + std::to_string(tp) : "") + " do not divide the " +
                                std::to_string(size) + " ranks of communicator '" + world->name() +
                                "': choose divisors of the world size");
  const int shards = size / (replicas * tp), t = world->rank() % tp, dp_rank = world->rank() / tp;
  const int replica = dp_rank / shards, shard = dp_rank % shards;
  // With tp, each dp communicator holds one tp index: its name says which.
  const std::string of_t = tp > 1 ? ".tp" + std::to_string(t) : "";
  Mesh mesh;
  mesh.shard = world->split(replica * tp + t, shard, world->name() + ".replica" + std::to_string(replica) + of_t);
  mesh.replicate = world->split(shard * tp + t, replica, world->name() + ".shard" + std::to_string(shard) + of_t);
  if (tp > 1) {
    mesh.tp = world->split(dp_rank, t, world->name() + ".dp" + std::to_string(dp_rank));
    mesh.replica = world->split(replica, shard * tp + t, world->name() + ".replica" + std::to_string(replica));
  }
  return mesh;
}

}  // namespace fsdp
