"""A model sharded with FSDP2 (``fully_shard``) from Python: the step reduce-scatters once per optimizer
step and trains it as DDP trains the unsharded model (issue 22's first piece; CPU, gloo)."""
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.functional import cross_entropy

from ignite_amp import create_amp_trainer
from ignite_amp.handlers import GradientClipping


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train(model, rank, syncs=None):
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32", accumulation_steps=2, micro_batches=2)
    GradientClipping(max_norm=0.5).attach(trainer)
    if syncs is not None:  # record what the step asks of FSDP before each backward
        ask = model.set_requires_gradient_sync
        model.set_requires_gradient_sync = lambda value, **kw: (syncs.append(value), ask(value, **kw))
    g = torch.Generator().manual_seed(rank)
    trainer.run([(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(4)])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compare(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sharded, syncs = build(), []
        fully_shard(sharded)
        train(sharded, rank, syncs)
        full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
        plain = build()
        train(torch.nn.parallel.DistributedDataParallel(plain), rank)
        diff = max(float((full[k] - v).abs().max() / v.abs().max()) for k, v in plain.state_dict().items())
        torch.save({"diff": diff, "syncs": syncs}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_trains_like_ddp_with_one_reduce_scatter_per_optimizer_step(tmp_path):
    torch.multiprocessing.spawn(_compare, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["diff"] < 1e-6, result["diff"]  # float32: the same sums in another order
        # 4 batches = 2 optimizer steps of 2 iterations x 2 micro-batches: only each step's last backward syncs.
        assert result["syncs"] == [False, False, False, True] * 2
