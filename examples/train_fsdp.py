"""Train a built-in Llama with remat + FSDP2, launched by torchrun.

Checkpointing first, then (optionally) per-block torch.compile, then ``fully_shard``
per block and at the root: ``remat.integrations.fsdp2.apply_fsdp`` does that order.
Gradient accumulation skips FSDP2's reduce-scatter on all but the last micro-batch
(``set_requires_gradient_sync``). The same script runs on CPU (gloo) and on GPUs
(NCCL), chosen from what the machine has.

Examples::

    # 2 CPU processes, the full strategy, 2 micro-batches per step
    torchrun --nproc_per_node 2 examples/train_fsdp.py --model llama-tiny --strategy full

    # 8 GPUs, a plan that fits 20 GiB per GPU (needs remat.plan)
    torchrun --nproc_per_node 8 examples/train_fsdp.py --model llama-1b --budget 20GiB \\
        --micro-batch 4 --seq 2048 --grad-accum 4 --compile
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat.integrations.fsdp2 import apply_fsdp, single_device_budget_bytes
from remat.models import PRESETS, build_model, make_batch
from remat.strategies import applied
from remat.units import format_bytes, parse_bytes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS),
                        help="built-in preset (default: llama-tiny)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--strategy", default=None,
                     help="remat strategy: none, full, every:N, sqrt, attn, mlp, ops, offload "
                          "(default: full)")
    how.add_argument("--budget", default=None,
                     help="memory per rank, e.g. 20GiB: plan with remat.plan for it")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: 5)")
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="sequences per rank per micro-batch (default: 4)")
    parser.add_argument("--grad-accum", type=int, default=2,
                        help="micro-batches per optimizer step (default: 2)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default: the preset's max_seq_len)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--dataset-size", type=int, default=16,
                        help="synthetic sequences in the training set, cycled (default: 16)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.strategy is None and args.budget is None:
        args.strategy = "full"
    for name in ("steps", "micro_batch", "grad_accum", "dataset_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def setup() -> tuple[int, int, torch.device]:
    """Initialise the process group from torchrun's environment: NCCL on GPUs, else gloo."""
    if "RANK" not in os.environ:
        raise SystemExit(
            "train_fsdp.py: run me with torchrun, e.g. "
            "torchrun --nproc_per_node 2 examples/train_fsdp.py --strategy full"
        )
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        # Ranks share the CPU: without this each one starts a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


class SyntheticTokens:
    """A fixed set of random sequences, split across ranks and cycled (stands in for a loader)."""

    def __init__(self, preset: str, size: int, seq_len: int | None, *, rank: int, world: int,
                 device: torch.device, seed: int) -> None:
        data = make_batch(preset, size, seq_len, seed=seed)["input_ids"]  # (N, T)
        self.shard = data[rank::world].to(device)  # this rank's sequences
        if len(self.shard) == 0:
            raise SystemExit(f"train_fsdp.py: --dataset-size {size} < world size {world}")
        self.position = 0

    def next(self, micro_batch: int) -> dict[str, torch.Tensor]:
        rows = [(self.position + i) % len(self.shard) for i in range(micro_batch)]
        self.position = (self.position + micro_batch) % len(self.shard)
        ids = self.shard[rows]
        return {"input_ids": ids, "labels": ids.clone()}


def plan_for_budget(model: nn.Module, batch: dict[str, torch.Tensor], budget: str, *,
                    rank: int, world: int, lr: float) -> Any:
    """Plan on rank 0 for a per-rank budget, then give every rank the same plan."""
    try:
        from remat.planning import Plan
        from remat.planning import plan as make_plan
    except ImportError as exc:
        raise SystemExit("train_fsdp.py: --budget needs remat.plan; use --strategy") from exc
    from remat.errors import BudgetTooSmall
    from remat.measure import profile

    result: list[Any] = [None]
    if rank == 0:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        prof = profile(model, batch, optimizer=optimizer, timing=False)
        single = single_device_budget_bytes(parse_bytes(budget), prof, model, world_size=world)
        saved = single - parse_bytes(budget)  # what sharding saves per rank
        print(f"budget {budget} per rank = {format_bytes(single)} on one device: FSDP saves "
              f"{format_bytes(saved)} of parameters, gradients and optimizer state per rank",
              flush=True)
        try:
            result[0] = make_plan(model, batch, budget=single, optimizer=optimizer).to_json()
        except BudgetTooSmall as exc:
            message = (f"no plan fits {budget} per rank; the smallest per-rank peak is "
                       f"{format_bytes(exc.min_peak_bytes - saved)}. Raise --budget, or lower "
                       "--micro-batch / --seq.")
            result[0] = ("error", message)
        for p in model.parameters():
            p.grad = None
    dist.broadcast_object_list(result, src=0)  # the plan as JSON, or why there is none
    if isinstance(result[0], tuple):
        dist.destroy_process_group()
        raise SystemExit(f"train_fsdp.py: {result[0][1]}")
    return Plan.from_json(result[0])


def main() -> None:
    args = parse_args()
    rank, world, device = setup()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with torch.device(device):
        model = build_model(args.model)
    data = SyntheticTokens(args.model, args.dataset_size, args.seq, rank=rank, world=world,
                           device=device, seed=args.seed + 1)
    strategy: Any = args.strategy
    if args.budget is not None:
        strategy = plan_for_budget(model, data.next(args.micro_batch), args.budget, rank=rank,
                                   world=world, lr=args.lr)
        data.position = 0
    apply_fsdp(model, strategy, compile=args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    info = applied(model)
    label = args.strategy or "plan (" + ", ".join(
        f"{name}={kind}" for name, kind in (info.decisions if info else ())) + ")"
    log(rank, f"{args.model} on {world} x {device.type} ({dist.get_backend()}), strategy "
              f"{label}, {args.grad_accum} x {args.micro_batch} sequences per rank per step")
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        total = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            # Reduce-scatter gradients only after the last micro-batch.
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)  # type: ignore[operator]
            loss = model(**data.next(args.micro_batch)).loss / args.grad_accum
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        memory = ""
        if device.type == "cuda":
            memory = f" | peak {format_bytes(torch.cuda.max_memory_allocated(device))}"
        log(rank, f"step {step} | loss {total.item() / world:.4f} | {elapsed_ms:.0f} ms{memory}")
    # Every rank leaves together, then skips interpreter finalization: gloo's C++ worker
    # threads can still hold work objects whose tensors need the GIL while Python tears down,
    # which aborts the process now and then ("terminate called without an active exception",
    # pytorch/pytorch#179291), after the training itself has finished fine.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
