#!/usr/bin/env bash
# Two "nodes" on one host: two torchrun agents started as on two
# machines (--nnodes 2, --node-rank 0 and 1, static rendezvous at node 0's address), each seeing
# only its own GPUs through CUDA_VISIBLE_DEVICES, as a second machine would. Every rank prints its
# launch variables, then runs the command; exits non-zero if either node does.
#   bash bench/two_nodes_on_one_host.sh GPUS_PER_NODE PORT COMMAND...
set -uo pipefail
per_node=${1:?GPUs per node}; port=${2:?rendezvous port}; shift 2
show='node $GROUP_RANK: rank $RANK of $WORLD_SIZE, local rank $LOCAL_RANK of $LOCAL_WORLD_SIZE, GPUs'
show+=' $CUDA_VISIBLE_DEVICES, store $MASTER_ADDR:$MASTER_PORT, agent store $TORCHELASTIC_USE_AGENT_STORE'
node() {  # node RANK: that node's torchrun, its GPUs the RANK-th block of per_node
  local node_rank=$1 first=$(($1 * per_node))
  shift
  CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + per_node - 1))) python3 -m torch.distributed.run \
    --nnodes 2 --node-rank "$node_rank" --nproc-per-node "$per_node" --master-addr 127.0.0.1 --master-port "$port" \
    --no-python -- sh -c "echo \"$show\"; exec \"\$@\"" rank "$@" 2>&1 |
    sed "s/^/[node $node_rank] /"
  return "${PIPESTATUS[0]}"
}
node 0 "$@" & first=$!
node 1 "$@"; second=$?
wait $first; status=$?
echo "two_nodes_on_one_host: node 0 exit $status, node 1 exit $second"
[ $status -eq 0 ] && [ $second -eq 0 ]
