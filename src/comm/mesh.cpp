#include "fsdp/mesh.h"

#include <stdexcept>
#include <string>

#include "fsdp/launch.h"

namespace fsdp {

Mesh make_mesh(int replicas, std::shared_ptr<Communicator> world) {
  if (!world) world = default_communicator();
  const int size = world->world_size();
  if (replicas < 1 || size % replicas != 0)
    throw std::invalid_argument("fsdp::make_mesh: " + std::to_string(replicas) + " replicas do not divide the " +
                                std::to_string(size) + " ranks of group '" + world->group_name() +
                                "': choose a divisor of the world size");
  const int shards = size / replicas, replica = world->rank() / shards, shard = world->rank() % shards;
  Mesh mesh;
  mesh.shard = world->split(replica, shard, world->group_name() + ".replica" + std::to_string(replica));
  mesh.replicate = world->split(shard, replica, world->group_name() + ".shard" + std::to_string(shard));
  return mesh;
}

}  // namespace fsdp
