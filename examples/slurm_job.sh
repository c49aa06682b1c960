# The body of a multi-node Cephalo job, sourced by examples/*.sbatch from the repository root
# (docs/multinode.md: Install, Network, Timeouts): the environment, checked, then `cephalo_fit CONFIG
# [ARGS...]`, the launch. It stops the job with one `error:` line, before any training process starts,
# when the environment cannot work:
#
#   CEPHALO_VENV         the virtual environment with CUDA torch and cephalo-lightning (required: the
#                        clone's .venv from `make` holds the CPU wheel); CEPHALO_ALLOW_CPU=1 accepts a
#                        CPU torch (a CPU trial of the script, as tests/test_slurm_example.py runs it)
#   NCCL_SOCKET_IFNAME   the network interface that joins the nodes (required): `ip -br addr` on a node
#                        lists them; an exact name (eno1) or a prefix (en); GLOO_SOCKET_IFNAME (gloo's
#                        groups: checkpoints in the background) follows it unless set
#   NCCL_IB_DISABLE      1 (the default here): Ethernet between the nodes; 0 on InfiniBand (below)
#   PLAN                 a plan JSON to pin (its rank order = the global rank order); unset: profile at setup

if [[ -z "${CEPHALO_VENV:-}" ]]; then
    echo "error: set CEPHALO_VENV to the virtual environment with CUDA torch and cephalo-lightning, e.g. CEPHALO_VENV=/shared/venvs/cephalo-cuda sbatch ... (docs/multinode.md, Install)" >&2
    exit 2
fi
if [[ -z "${NCCL_SOCKET_IFNAME:-}" ]]; then
    echo "error: set NCCL_SOCKET_IFNAME to the network interface that joins the nodes (ip -br addr on a node lists them), e.g. NCCL_SOCKET_IFNAME=eno1 sbatch ... (docs/multinode.md, Network)" >&2
    exit 2
fi
source "$CEPHALO_VENV/bin/activate"
if [[ "${CEPHALO_ALLOW_CPU:-0}" != 1 ]]; then
    # CUDA torch, and a GPU visible on this node (the CPU wheel's torch.version.cuda is None)
    check='import torch; cuda = torch.version.cuda; assert torch.cuda.is_available(), f"the CPU build of torch {torch.__version__}" if cuda is None else f"torch {torch.__version__} (CUDA {cuda}) sees no GPU"; print(torch.__version__)'
    if ! found=$(python -c "$check" 2>&1); then
        echo "error: CEPHALO_VENV=$CEPHALO_VENV cannot train on GPUs on $(hostname) (${found##*$'\n'}): install torch from the CUDA index into it (docs/multinode.md, Install), or check --gpus-per-node and nvidia-smi" >&2
        exit 2
    fi
    echo "torch $found with CUDA in $CEPHALO_VENV"
fi

# Network. Ethernet (10/25/100 GbE): NCCL's sockets on the named interface, InfiniBand off.
export NCCL_SOCKET_IFNAME NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}"
# InfiniBand instead (every node with an HCA): submit with NCCL_IB_DISABLE=0, and NCCL_SOCKET_IFNAME the
# IPoIB or Ethernet interface NCCL bootstraps over; NCCL_IB_HCA picks the adapters (ibv_devinfo lists them):
#   NCCL_IB_DISABLE=0 NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5 sbatch ...
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"   # INFO on a first trial: the log names the transport (NET/Socket or NET/IB) and interface
# a collective that outlives the process-group timeout aborts its process instead of hanging (torchrun's default; srun sets none)
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

export CUDA_DEVICE_ORDER=PCI_BUS_ID   # local rank r = GPU r as nvidia-smi numbers them
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}"
export WANDB_MODE="${WANDB_MODE:-offline}"   # `wandb sync <vars.out>/wandb/offline-run-*` later

# Global rank = node index x tasks per node + local rank, and SLURM orders the allocation's nodes by its
# own hostlist order (usually by name), not by the order written in --nodelist. Print the mapping, so the
# log says which node holds ranks 0-3 (a pinned plan must list those GPUs first), each node's GPUs and the
# interface's address.
echo "nodes in rank order: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\n' ' ')"
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash -c 'echo "$(hostname): $(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tr "\n" ";") $(ip -br addr 2>/dev/null | awk -v p="$NCCL_SOCKET_IFNAME" "index(\$1, p) == 1 {print \$1, \$3}")"'

# srun starts every process (one per GPU); Lightning's SLURMEnvironment reads SLURM_PROCID / SLURM_LOCALID /
# SLURM_NODEID. --kill-on-bad-exit=1: one rank that dies ends the others at once, instead of leaving them
# in a collective until the process-group timeout (the config's strategy timeout). --ckpt_path=last: a
# requeued job resumes from the newest of last-preempted.ckpt and last.ckpt (none on the first run).
cephalo_fit() {
    local config="$1"
    shift
    local extra=()
    if [[ -n "${PLAN:-}" ]]; then
        extra+=("--trainer.strategy.init_args.plan=${PLAN}")
    fi
    srun --kill-on-bad-exit=1 python -m cephalo_lightning fit \
        --config "$config" \
        --trainer.num_nodes="$SLURM_JOB_NUM_NODES" \
        --trainer.devices="$SLURM_NTASKS_PER_NODE" \
        --ckpt_path=last \
        ${extra[@]+"${extra[@]}"} "$@"
}
