"""The Python front end's cases, each run on every rank under fsdp-run (test_fsdpcpp.py starts
them): python cases.py CASE [options]. A case asserts its outcome and exits 0, or raises. What they
share (the batches, the single-process reference and its parity bounds, the loops) is in
common.py; the sweep of changes to a sharded model's parameters in touches.py."""

import argparse
import atexit
import copy
import gc
import json
import os
import sys
import time

import torch
import torch.utils.checkpoint
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdpcpp  # noqa: E402
import common  # noqa: E402
from common import (Reference, batch, build, check_parity, check_torch_loop, expect_error, fully_shard_of,  # noqa: E402
                    my_rows, optimizer_for, shard, sharded_step, torch_loop, train_sharded)
from models import MODELS, blocks_of, checkpoint_calls, loss_of, tensor_parallel  # noqa: E402
from touches import TOUCH_CASES  # noqa: E402


def case_parity(args):
    steps = 4
    ref = Reference(args.model, steps, clip=args.clip, accum=args.accum)
    model = build(args.model)
    # --lr-scale 1.01: an error of 1% of the learning rate, which the bounds must catch.
    opt = optimizer_for(model, args.lr_scale) if args.optimizer_before or args.lr_scale != 1 else None
    calls = []
    if args.checkpoint_calls:
        checkpoint_calls(model)
        # The block's first submodule runs again when the block is recomputed.
        next(blocks_of(model)[0].children()).register_forward_pre_hook(lambda *_: calls.append(1))
    shard(model, checkpointed=args.checkpointed, reshard=not args.keep_after_forward)
    losses, _ = train_sharded(model, steps, clip=args.clip, accum=args.accum, optimizer=opt,
                              optimizer_before=args.optimizer_before)
    if args.checkpoint_calls:  # each step's forward, and its recomputation in backward
        assert len(calls) == 2 * steps * args.accum, f"block 0's first part ran {len(calls)} times in {steps} steps"
    check_parity(ref, losses, model, f"{args.model} (optimizer {'before' if args.optimizer_before else 'after'} "
                 f"sharding{', checkpointed blocks' if args.checkpointed else ''}"
                 f"{', checkpoint around each block call' if args.checkpoint_calls else ''}{f', clip {args.clip}' if args.clip else ''}"
                 f"{f', {args.accum} micro-batches' if args.accum > 1 else ''})")


def bf16_reference(name, steps, world):
    """FSDP2's mixed precision by hand, in one process, with the sharded run's arithmetic: each
    step every rank's rows run through a bfloat16 copy of the float32 parameters, their bfloat16
    gradients are cast to float32 and averaged over the ranks (the float32 reduce-scatter), and the
    float32 optimizer steps on them."""
    master = build(name)
    opt = optimizer_for(master)
    losses = []
    for step in range(steps):
        rank_losses, rank_grads = [], []
        for rows in batch(step).chunk(world):
            work = copy.deepcopy(master)
            for p in work.parameters():  # parameters only: buffers (RoPE's frequencies) keep their dtype
                p.data = p.data.to(torch.bfloat16)
            loss = loss_of(work, rows)
            loss.backward()
            rank_losses.append(loss.detach().reshape(1))
            rank_grads.append([w.grad.float() for w in work.parameters()])
        for i, p in enumerate(master.parameters()):
            p.grad = sum(g[i] for g in rank_grads) / world
        opt.step()
        opt.zero_grad()
        losses.append(sum(rank_losses).item() / world)
    return losses, {n: p.detach().cpu() for n, p in master.named_parameters()}


def case_mixed_precision(args):
    """bfloat16 compute, float32 reduce-scatter and master weights, on 1 or 2 ranks: the same
    arithmetic as bf16_reference in the same order (a sum of two is the same in either order), so
    losses and parameters must be equal bit for bit."""
    steps = 3
    assert fsdpcpp.world_size() <= 2, "mixed_precision runs on 1 or 2 ranks (its reference's sums are exact there)"
    ref_losses, ref_params = bf16_reference(args.model, steps, fsdpcpp.world_size())
    model = build(args.model)
    mp = fsdpcpp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dtypes = set()
    blocks_of(model)[0].register_forward_hook(lambda m, i, o: dtypes.update(p.dtype for p in m.parameters()))
    shard(model, mp=mp)
    losses, _ = train_sharded(model, steps)
    assert dtypes == {torch.bfloat16}, f"the block computed with {dtypes} parameters, not bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "the sharded parameters left float32"
    full = fsdpcpp.get_model_state_dict(model)
    worst = max((full[n] - p).abs().max().item() for n, p in ref_params.items())
    assert losses == ref_losses and worst == 0, f"losses {losses} vs {ref_losses}, parameters differ by {worst:.3g}"
    only = fsdpcpp.get_model_state_dict(model, rank0_only=True)
    if fsdpcpp.rank() == 0:
        assert sorted(only) == sorted(full) and all(torch.equal(only[k], full[k]) for k in full), \
            "get_model_state_dict(rank0_only=True) differs from the full state dict on rank 0"
    else:
        assert only == {}, f"rank {fsdpcpp.rank()} kept {len(only)} tensors under rank0_only=True"
    if fsdpcpp.rank() == 0:
        print(f"{args.model}, bfloat16 parameters, float32 reduce: equal to the reference bit for bit on "
              f"{fsdpcpp.world_size()} ranks")


def case_torch_calls(args):
    """An FSDP2 training loop as its users write it, on --runtime fsdp2 or fsdpcpp (only the
    fully_shard import differs): torch.nn.utils.clip_grad_norm_, a DCP checkpoint of torch's
    get_state_dict (model and optimizer) at step 2 loaded into a fresh model and optimizer with
    set_state_dict, or --resume-from another run's checkpoint (the other runtime's: they are
    interchangeable), then torch's full get_model_state_dict and numel. Losses, gradient norms and
    final parameters must match a single-process reference within the parity bounds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    fully_shard, mesh, tp_mesh = fully_shard_of(args.runtime, args.replicas, args.tp)
    clip, steps = 0.5, 4
    ref = Reference(args.model, steps, clip=clip)

    def fresh():
        model = build(args.model)
        if tp_mesh is not None:
            tensor_parallel(model, tp_mesh)
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, optimizer_for(model)

    def load(model, opt, path):
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    restarts = []

    def restart_at_step_2(step):
        if step != 2 or args.resume_from:
            return None
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(args.dir, "step-2"))
        restarted = fresh()  # as a job that restarts
        load(*restarted, os.path.join(args.dir, "step-2"))
        restarts.append(restarted)
        return restarted

    model, opt = fresh()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.model.parameters()), "numel"
    first = 2 if args.resume_from else 0
    if args.resume_from:
        load(model, opt, args.resume_from)
    model, losses, norms = torch_loop(model, opt, steps, clip, first, before_step=restart_at_step_2, tp=args.tp)
    check_torch_loop(f"torch_calls: {args.model} on {args.runtime}, a dp mesh of shape {tuple(mesh.shape)}, tp {args.tp}"
                     f"{', resumed from ' + args.resume_from if args.resume_from else ''}",
                     ref, model, losses, norms, first)
    if args.tp > 1 and args.runtime == "fsdpcpp":
        opt = restarts[-1][1] if restarts else opt  # the restarted job's
        check_tensor_parallel_refusals(model, opt, tp_mesh, args)
        if not args.resume_from and args.replicas == 1:
            check_planned_under_tp(model, opt, steps, clip, args)


def case_optimizer_in_backward(args):
    """PyTorch's recipe for the optimizer step in backward, as FSDP2 runs it: an AdamW a parameter,
    stepped and zeroed by the parameter's post-accumulate-grad hook once its sharded gradient is
    there, no optimizer step after backward. The losses and the parameters of the single-process
    reference that steps after backward, within its parity bounds; every hook ran once a step, the
    later blocks' before backward reached the first block."""
    fully_shard, mesh, _ = fully_shard_of(args.runtime, 1, 1)
    steps = 3
    ref = Reference(args.model, steps, clip=float("inf"))  # records the norms (x1 leaves the step alone)
    model = build(args.model)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = {p: optimizer_for([p]) for p in model.parameters()}
    stepped = []

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad()
        stepped.append(p)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    # How many hooks had run when backward reached the first block's input: those of the later
    # blocks, each group's once its gradients were reduced (FSDP2's timing; none if they waited
    # for the end of backward).
    first_block_reached = []

    def count_at_its_input(_, inputs):
        inputs[0].register_hook(lambda grad: first_block_reached.append(len(stepped)))

    blocks_of(model)[0].register_forward_pre_hook(count_at_its_input)
    losses = []
    for s in range(steps):
        loss = loss_of(model, my_rows(batch(s)))
        loss.backward()
        assert len(stepped) == len(optimizers) * (s + 1), f"step {s}: {len(stepped)} hooks ran"
        later_blocks = sum(1 for b in blocks_of(model)[1:] for _ in b.parameters())
        assert first_block_reached[-1] - len(optimizers) * s >= later_blocks, (
            f"step {s}: {first_block_reached[-1] - len(optimizers) * s} hooks had run when backward reached the first "
            f"block, not the {later_blocks} of the later blocks")
        assert all(p.grad is None for p in model.parameters()), "a gradient the hook zeroed is still there"
        loss = loss.detach().clone()
        fsdpcpp.all_reduce(loss, op="avg")
        losses.append(loss.item())
    # The gradients are gone with the steps: the norms given are the reference's own, so the
    # losses and the parameters are what is compared.
    check_torch_loop(f"optimizer_in_backward: {args.model} on {args.runtime}", ref, model, losses, ref.norms)


def check_planned_under_tp(model, opt, first, clip, args):
    """fsdpcpp.plan_memory_budget on the tp-split model plans the layout it runs, as profiled (the
    DTensor ops' tp collectives inside each module's compute): a 1 KiB budget refused, naming the
    smallest, and a budget near it planned; every step from `first` on, the planner's ten included,
    within the parity bounds of one process, and the planned step under the budget."""
    losses, norms = [], []

    def train_step():
        step = first + len(losses)
        _, loss, norm = torch_loop(model, opt, step + 1, clip, first=step, tp=args.tp)
        losses.extend(loss)
        norms.extend(norm)

    try:
        fsdpcpp.plan_memory_budget(model, train_step, 1 << 10, verbose=False)
        raise AssertionError("a 1 KiB budget was not refused")
    except fsdpcpp.BudgetTooSmall as refused:
        assert "smallest" in str(refused), str(refused)
        # A tenth above it: a second profile may peak a few allocations higher.
        budget = refused.smallest_budget_bytes * 11 // 10
    plan = fsdpcpp.plan_memory_budget(model, train_step, budget, verbose=False)
    fsdpcpp.reset_peak_allocated()
    train_step()
    measured = fsdpcpp.allocated_bytes()["peak"]
    assert measured <= budget, f"the planned step peaked at {measured} bytes, over the budget {budget}: {plan}"
    check_torch_loop(f"torch_calls: {args.model} on fsdpcpp at tp {args.tp}, planned ({plan.description})",
                     Reference(args.model, first + len(losses), clip=clip), model, losses, norms, first)


def check_tensor_parallel_refusals(model, opt, tp_mesh, args):
    """What fsdpcpp cannot follow under tensor parallelism is refused, naming the parameter and
    what to use instead: its own clip and checkpoints (torch's work), and a module split over
    other ranks than the tp ranks of this rank's dp mesh (a mesh laid out (tp, dp))."""
    expect_error(NotImplementedError, "split by tensor parallelism, which this call does not follow: use "
                 "torch.nn.utils.clip_grad_norm_", lambda: fsdpcpp.clip_grad_norm_(model.parameters(), 1.0))
    expect_error(NotImplementedError, "use torch.distributed.checkpoint (DCP)",
                 lambda: fsdpcpp.save_checkpoint(os.path.join(args.dir or ".", "own"), model, opt))
    from torch.distributed.device_mesh import init_device_mesh
    world = fsdpcpp.world_size()
    across = init_device_mesh(tp_mesh.device_type, (args.tp, world // args.tp), mesh_dim_names=("tp", "dp"))["tp"]
    other = tensor_parallel(build(args.model), across)
    expect_error(NotImplementedError, "not this rank's tp ranks", lambda: fsdpcpp.fully_shard(blocks_of(other)[0]))


def case_meta_init(args):
    """FSDP2's recipe for a model larger than one device, on --runtime fsdp2 or fsdpcpp:
    transformers' Llama built on meta, sharded, to_empty (each rank allocates its rows),
    transformers' init_weights (random rows through the sharded parameters, and the rotary
    buffers, which no state dict holds), then the reference's weights: a full state dict that only
    rank 0 has, loaded with broadcast_from_rank0, or (--load safetensors) the model's
    save_pretrained files read by DCP's HuggingFaceStorageReader, each rank reading its rows.
    Rank 0 writes the parameters as init_weights left them to DIR/init.pt (the test compares the
    two runtimes'); the run then trains to parity with a single-process reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    fully_shard, mesh, _ = fully_shard_of(args.runtime)
    clip, steps = 0.5, 3
    ref = Reference("llama", steps, clip=clip)
    with torch.device("meta"):
        model = MODELS["llama"]()
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=fsdpcpp.device())
    torch.manual_seed(1)
    model.init_weights()
    initialised = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if fsdpcpp.rank() == 0:
        torch.save(initialised, os.path.join(args.dir, "init.pt"))
    else:
        assert not initialised, "cpu_offload=True: a full state dict on rank 0 only"
    if args.load == "safetensors":
        import torch.distributed.checkpoint as dcp
        if fsdpcpp.rank() == 0:
            build("llama").save_pretrained(os.path.join(args.dir, "hf"))
        fsdpcpp.all_reduce(torch.zeros(1, device=fsdpcpp.device()))  # the files are written
        dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(os.path.join(args.dir, "hf")))
    else:
        source = build("llama").state_dict() if fsdpcpp.rank() == 0 else {}
        set_model_state_dict(model, source,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    model, losses, norms = torch_loop(model, optimizer_for(model), steps, clip)
    check_torch_loop(f"meta_init: {args.runtime}", ref, model, losses, norms)


def case_another_mesh(args):
    """fully_shard's mesh is every live sharded module's: another is refused while one lives and
    taken once none does (a process that trains one model, then another over another mesh)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    world, device = fsdpcpp.world_size(), fsdpcpp.device()
    first = fsdpcpp.fully_shard(nn.Linear(4, 4, device=device))  # FSDP2's default 1-D mesh (and torch's group)
    one_replica = DeviceMesh(device.type, [list(range(world))])  # HSDP's 2-D layout: 1 replica of every rank
    expect_error(ValueError, f"a mesh of shape (1, {world}) after one of shape ({world},): shard every module over one mesh",
                 lambda: fsdpcpp.fully_shard(nn.Linear(4, 4, device=device), mesh=one_replica))
    del first
    gc.collect()
    second = fsdpcpp.fully_shard(nn.Linear(4, 4, device=device), mesh=one_replica)
    second(torch.ones(2, 4, device=device)).sum().backward()
    assert second.weight.placements == (Replicate(), Shard(0)), second.weight.placements
    assert second.weight.grad.placements == (Replicate(), Shard(0)), second.weight.grad.placements
    # Every row's gradient is the two ones-rows' sum, 2, on every rank's rows.
    assert torch.equal(second.weight.grad.full_tensor(), torch.full((4, 4), 2.0, device=device))


def case_group_member_skipped(args):
    """fully_shard([norm, head]) where some forwards skip the head: the group's forward ends with
    the root's, and training (SGD, every rank its rows of one batch) matches a single process
    step by step: the head's weight unchanged by the steps that skipped it. A forward that raises
    between the two (the group open) leaves the next steps as they were."""
    from torch.distributed.tensor import DTensor

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x, head, fail=False):
            x = self.norm(self.body(x))
            if fail:
                raise ValueError("a forward that fails")
            return self.head(x) if head else x

    torch.manual_seed(0)
    reference = Model().to(fsdpcpp.device())
    sharded = copy.deepcopy(reference)
    fsdpcpp.fully_shard([sharded.norm, sharded.head])
    fsdpcpp.fully_shard(sharded)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, sharded)]
    rows = 4 * fsdpcpp.world_size()
    for step, head in enumerate([True, False, True, False]):
        if step == 2:
            expect_error(ValueError, "a forward that fails", lambda: sharded(torch.ones(2, 8, device=fsdpcpp.device()),
                                                                            True, fail=True))
            assert isinstance(sharded.norm.weight, DTensor), "the failed forward left the group's forward open"
        x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(step)).to(fsdpcpp.device())
        mine = x.chunk(fsdpcpp.world_size())[fsdpcpp.rank()]
        for model, opt, batch in ((reference, optimizers[0], x), (sharded, optimizers[1], mine)):
            model(batch, head).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for (name, expected), got in zip(reference.named_parameters(), sharded.parameters()):
            got = got.full_tensor() if isinstance(got, DTensor) else got
            assert torch.allclose(got, expected, rtol=0, atol=1e-6), f"step {step} (head {head}): {name} differs"
    if fsdpcpp.rank() == 0:
        print("group_member_skipped: at parity with the head skipped in steps 1 and 3, and a failed forward")


def case_save(args):
    """Trains 2 of 4 steps and saves model and optimizer (resume continues on any rank count)."""
    model = shard(build(args.model))
    _, opt = train_sharded(model, 2)
    fsdpcpp.save_checkpoint(os.path.join(args.dir, fsdpcpp.checkpoint_name(2)), model, opt,
                            extra={"step": 2, "ranks": fsdpcpp.world_size()})
    full = fsdpcpp.get_model_state_dict(model, rank0_only=True)  # what the offline converter must give
    if fsdpcpp.rank() == 0:
        torch.save(full, os.path.join(args.dir, "full.pt"))


def case_resume(args):
    """Resumes case_save's checkpoint and trains steps 3 and 4: the run must match a 4-step
    single-process reference, as if never interrupted."""
    ref = Reference(args.model, 4)
    model = shard(build(args.model))
    opt = optimizer_for(model)
    path = fsdpcpp.newest_checkpoint(args.dir)
    extra = fsdpcpp.load_checkpoint(path, model, opt)
    assert extra["step"] == "2", extra
    losses, _ = train_sharded(model, 2, first_step=2, optimizer=opt)
    ref.losses, ref.relative = ref.losses[2:], ref.relative[2:]
    check_parity(ref, losses, model, f"{args.model} saved on {extra['ranks']} ranks, resumed")


def case_errors(args):
    """Bad input raises Python exceptions whose one-line messages name the problem and the fix."""
    model = build("plain")
    block = blocks_of(model)[0]
    fsdpcpp.fully_shard(block)
    expect_error(ValueError, "already sharded: call fully_shard once per module", lambda: fsdpcpp.fully_shard(block))
    expect_error(ValueError, f"fully_shard({type(block).__name__}): already sharded", lambda: fsdpcpp.fully_shard([block]))
    top_down = build("plain")
    fsdpcpp.fully_shard(top_down)
    expect_error(ValueError, "Apply fully_shard bottom-up", lambda: fsdpcpp.fully_shard(blocks_of(top_down)[0]))
    # On meta: the shard is allocated, zeros; a later dtype or device change is refused.
    on_meta = fsdpcpp.fully_shard(torch.nn.Linear(4, 4, device="meta"))
    assert on_meta.weight.to_local().device == fsdpcpp.device() and not on_meta.weight.to_local().any()
    expect_error(ValueError, "refused and undone: 'weight' became torch.float64; the shards are torch.float32",
                 lambda: on_meta.to(torch.float64))
    assert on_meta.weight.dtype == torch.float32 and on_meta.weight.to_local().device == fsdpcpp.device()
    expect_error(TypeError, "expected an nn.Module or a list of them", lambda: fsdpcpp.fully_shard([block, 1]))
    expect_error(ValueError, "already sharded", lambda: fsdpcpp.fully_shard([torch.nn.Linear(2, 2), block]))
    # shard_placement_fn: rows are what the runtime does; another dimension is refused by name.
    from torch.distributed.tensor import Shard
    rows = fsdpcpp.fully_shard(torch.nn.Linear(4, 4, device=fsdpcpp.device()), shard_placement_fn=lambda p: Shard(0))
    expect_error(NotImplementedError, "shard_placement_fn gave Shard(dim=1) for 'weight'",
                 lambda: fsdpcpp.fully_shard(torch.nn.Linear(4, 4, device=fsdpcpp.device()),
                                             shard_placement_fn=lambda p: Shard(1)))
    # torch's own policy classes, as FSDP2 scripts import them, are read as fsdpcpp's.
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
    expect_error(NotImplementedError, "CPUOffloadPolicy(pin_memory=False) is not supported",
                 lambda: fsdpcpp.fully_shard(torch.nn.Linear(2, 2, device=fsdpcpp.device()),
                                             offload_policy=TorchCPUOffloadPolicy(pin_memory=False)))
    # ignored_params: left as they are (not sharded, the same tensor); the rest sharded.
    partly = torch.nn.Linear(4, 4, device=fsdpcpp.device())
    bias = partly.bias
    fsdpcpp.fully_shard(partly, ignored_params={partly.bias})
    from torch.distributed.tensor import DTensor
    assert partly.bias is bias and not isinstance(bias, DTensor) and not fsdpcpp._C.is_sharded_parameter(bias)
    assert isinstance(partly.weight, DTensor) and isinstance(rows.weight, DTensor)
    # A module of a list group cannot be recomputed alone, nor planned.
    grouped = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(fsdpcpp.device())
    fsdpcpp.fully_shard([grouped[0], grouped[1]])
    expect_error(NotImplementedError, "recomputing one module of a group is not supported",
                 lambda: fsdpcpp.set_recomputed(grouped[0], True))
    fsdpcpp.fully_shard(grouped)
    expect_error(NotImplementedError, "'0' was sharded in a list with other modules",
                 lambda: fsdpcpp.plan_memory_budget(grouped, lambda: None, 1 << 30))
    expect_error(TypeError, "mesh must be a torch.distributed DeviceMesh",
                 lambda: fsdpcpp.fully_shard(torch.nn.Linear(2, 2), mesh=1))
    if fsdpcpp.world_size() > 1:
        from torch.distributed.device_mesh import DeviceMesh
        reversed_ranks = DeviceMesh(fsdpcpp.device().type, list(reversed(range(fsdpcpp.world_size()))))
        expect_error(NotImplementedError, "over ranks [1, 0] is not supported",
                     lambda: fsdpcpp.fully_shard(torch.nn.Linear(2, 2, device=fsdpcpp.device()), mesh=reversed_ranks))
    # FSDP2's other FSDPModule methods: accepted where the runtime already does what they ask,
    # refused by name where it cannot; never an AttributeError.
    hinted = shard(build("plain"))
    hinted.set_modules_to_forward_prefetch(blocks_of(hinted)[:1])
    hinted.set_modules_to_backward_prefetch(blocks_of(hinted)[:1])
    hinted.set_is_last_backward(True)
    hinted.set_post_optim_event(None)
    hinted.set_requires_all_reduce(False)
    hinted.set_reshard_after_backward(True)
    # unshard(): the whole parameters in the module now, until reshard() or the end of a forward.
    full = fsdpcpp.get_model_state_dict(hinted)
    first = blocks_of(hinted)[0]
    first.unshard()
    assert not isinstance(first.qkv.weight, DTensor), type(first.qkv.weight)
    assert torch.equal(first.qkv.weight.detach().cpu(), full["layers.0.qkv.weight"]), "unshard(): not the full weight"
    first.reshard()
    assert isinstance(first.qkv.weight, DTensor), type(first.qkv.weight)
    handle = hinted.unshard(async_op=True)  # the root's, as a script prefetches it before the step
    handle.wait()
    loss = loss_of(hinted, my_rows(batch(0)))
    expected = loss_of(build("plain"), my_rows(batch(0)))
    assert torch.allclose(loss, expected, rtol=1e-6, atol=0), f"after unshard(): {loss.item()} vs {expected.item()}"
    loss.backward()
    assert isinstance(hinted.head.weight, DTensor) and hinted.head.weight.grad is not None
    expect_error(NotImplementedError, "set_reshard_after_backward(False) is not supported",
                 lambda: hinted.set_reshard_after_backward(False))
    expect_error(NotImplementedError, "set_gradient_divide_factor is not supported",
                 lambda: hinted.set_gradient_divide_factor(2.0))
    expect_error(NotImplementedError, "reshard_after_forward=2: True, False or None",
                 lambda: fsdpcpp.fully_shard(torch.nn.Linear(2, 2, device=fsdpcpp.device()), reshard_after_forward=2))
    if fsdpcpp.device().type == "cuda":
        expect_error(ValueError, "is on cpu but the communicator", lambda: fsdpcpp.fully_shard(torch.nn.Linear(4, 4)))
    # A model that differs across ranks: every rank learns which rank differs.
    different = torch.nn.Linear(4, 4 + fsdpcpp.rank() % 2, device=fsdpcpp.device())
    if fsdpcpp.world_size() > 1:
        expect_error(ValueError, "the model differs across ranks", lambda: fsdpcpp.fully_shard(different))
        # Float8 all-gather asked for on one rank only: the all-gather's buffers would differ in
        # size (a timeout blaming another rank), so fully_shard names it.
        from fsdpcpp.float8 import convert_to_float8_training
        marked = build("plain")
        if fsdpcpp.rank() == 0:
            convert_to_float8_training(marked)
        expect_error(ValueError, "with the same weights marked by enable_float8_all_gather",
                     lambda: fsdpcpp.fully_shard(blocks_of(marked)[0]))
    # clip_grad_norm_ over a parameter no fully_shard took.
    expect_error(ValueError, "is not sharded: apply fully_shard to the root module too",
                 lambda: fsdpcpp.clip_grad_norm_(torch.nn.Linear(2, 2, device=fsdpcpp.device()).parameters(), 1.0))
    # The planner: an unsharded model, a budget that is no size, a step of another micro-batch count.
    unsharded = torch.nn.Linear(2, 2, device=fsdpcpp.device())
    expect_error(ValueError, "the model is not sharded; fully_shard its blocks",
                 lambda: fsdpcpp.plan_memory_budget(unsharded, lambda: None, 1 << 30))
    expect_error(ValueError, "the module is not sharded; fully_shard it first",
                 lambda: fsdpcpp.set_recomputed(unsharded, True))
    planned = shard(build("plain"))
    opt = optimizer_for(planned)
    expect_error(ValueError, "budget_bytes is 0; pass the memory",
                 lambda: fsdpcpp.plan_memory_budget(planned, lambda: sharded_step(planned, opt, 0), 0))
    expect_error(ValueError, "train_step ran 1 forward passes of the model, micro_batches is 2",
                 lambda: fsdpcpp.plan_memory_budget(planned, lambda: sharded_step(planned, opt, 0), 1 << 30,
                                                    micro_batches=2))
    assert not any(fsdpcpp.is_recomputed(m) for m in planned.modules() if isinstance(m, fsdpcpp.FSDPModule)), \
        "a failed plan left recomputation on"
    # A checkpoint of another model.
    if args.dir:
        other = shard(build("gpt2"))
        expect_error(RuntimeError, "a checkpoint of another model",
                     lambda: fsdpcpp.load_checkpoint(fsdpcpp.newest_checkpoint(args.dir), other))
        check_failed_load_changes_nothing(args.dir, args.model)
        check_weights_load_without_the_optimizer(args.dir, args.model)
    if fsdpcpp.rank() == 0:
        print("errors: each raised with its one-line message")


def check_weights_load_without_the_optimizer(saved_dir, model_name):
    """case_save's checkpoint (model and AdamW) loaded with no optimizer: the weights are those a
    load with the optimizer gives, and rank 0 warns naming the optimizer state left out."""
    import warnings
    newest = fsdpcpp.newest_checkpoint(saved_dir)
    alone, whole = shard(build(model_name)), shard(build(model_name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdpcpp.load_checkpoint(newest, alone)
    fsdpcpp.load_checkpoint(newest, whole, optimizer_for(whole))
    got, want = fsdpcpp.get_model_state_dict(alone), fsdpcpp.get_model_state_dict(whole)
    assert all(torch.equal(got[k], want[k]) for k in want), "the weights loaded alone differ"
    said = [str(w.message) for w in caught if "left out the checkpoint's optimizer state" in str(w.message)]
    assert bool(said) == (fsdpcpp.rank() == 0), f"rank {fsdpcpp.rank()} warned: {said}"


def check_failed_load_changes_nothing(saved_dir, model_name):
    """A damaged copy of case_save's checkpoint of `model_name` (its last file's last byte): the
    load fails on every rank and leaves the model and the optimizer (which had no state) exactly as
    they were."""
    import shutil
    newest = fsdpcpp.newest_checkpoint(saved_dir)
    damaged = os.path.join(saved_dir, "damaged")
    if fsdpcpp.rank() == 0:
        shutil.copytree(newest, damaged)
        last = sorted(n for n in os.listdir(damaged) if n.startswith("shard-"))[-1]
        with open(os.path.join(damaged, last), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte ^ 0x40]))
    fsdpcpp.all_reduce(torch.zeros(1, device=fsdpcpp.device()))  # the copy exists before anyone reads it
    model = shard(build(model_name))
    opt = optimizer_for(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        fsdpcpp.load_checkpoint(damaged, model, opt)
        raise AssertionError("a damaged checkpoint loaded")
    except RuntimeError as e:
        assert "checksum mismatch" in str(e) or "failed on" in str(e), e
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert not changed and not opt.state, f"a failed load changed {changed}, optimizer state {len(opt.state)}"


def case_hf_roundtrip(args):
    """transformers' save_pretrained called on the sharded model by every rank (rank 0 writes the
    full state dict), from_pretrained back: the same logits; set_model_state_dict of the loaded
    weights into a fresh sharded model: the same parameters."""
    from transformers import AutoModelForCausalLM
    model = shard(build(args.model))
    train_sharded(model, 2)
    full = fsdpcpp.get_model_state_dict(model)
    model.save_pretrained(args.dir)
    fsdpcpp.all_reduce(torch.zeros(1, device=fsdpcpp.device()))  # the files are written before anyone reads them
    loaded = AutoModelForCausalLM.from_pretrained(args.dir).to(fsdpcpp.device())
    tokens = batch(0)[:, :-1]
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
        got = loaded(input_ids=tokens).logits
    assert torch.equal(expected, got), f"logits differ by {(expected - got).abs().max().item()}"
    fresh = shard(build(args.model))
    fsdpcpp.set_model_state_dict(fresh, loaded.state_dict())
    again = fsdpcpp.get_model_state_dict(fresh)
    for name, value in full.items():
        assert torch.equal(again[name], value), f"{name} changed through save_pretrained and from_pretrained"
    expect_error(KeyError, "missing keys", lambda: fsdpcpp.set_model_state_dict(fresh, {}))
    if fsdpcpp.rank() == 0:
        print(f"{args.model}: save_pretrained / from_pretrained round trip exact on {fsdpcpp.world_size()} ranks")


def case_compile(args):
    """torch.compile on each block before fully_shard (as torchtitan does): parity."""
    steps = 3
    ref = Reference(args.model, steps)
    model = build(args.model)
    for block in blocks_of(model):
        block.compile()
    shard(model)
    losses, _ = train_sharded(model, steps)
    check_parity(ref, losses, model, f"{args.model} with compiled blocks")


def case_trace(args):
    """A Chrome trace of one step names each group's forward, backward, all-gathers and
    reduce-scatters; runtime_stats counts the collectives; torch.profiler sees them as ranges."""
    model = shard(build("plain"))
    train_sharded(model, 1)
    before = fsdpcpp.runtime_stats()
    fsdpcpp.start_trace()
    train_sharded(model, 1)
    path = os.path.join(args.dir, f"trace-{fsdpcpp.rank()}.json")
    fsdpcpp.write_trace(path)
    after = fsdpcpp.runtime_stats()
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = [e.get("name", "") for e in events]
    groups = len(blocks_of(model)) + 1
    for kind in ("forward #", "backward #", "all-gather #", "reduce-scatter #"):
        assert sum(n.startswith(kind) for n in names) >= groups - (kind == "all-gather #"), (kind, names)
    assert after["reduce_scatters"] - before["reduce_scatters"] == groups, (before, after)
    assert after["order_departures"] == before["order_departures"], "the second step's order changed"
    # A user's own torch.profiler sees the same collectives, and the reshards, as ranges.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train_sharded(model, 1)
    ranges = [e.name for e in profile.events()]
    for kind in ("fsdp::all-gather #", "fsdp::reduce-scatter #", "fsdp::reshard #"):
        assert sum(n.startswith(kind) for n in ranges) >= groups - (kind == "fsdp::all-gather #"), (kind, ranges)
    if fsdpcpp.rank() == 0:
        print(f"trace: {len(events)} events, {after['reduce_scatters'] - before['reduce_scatters']} reduce-scatters")


def case_timeout(args):
    """Rank 1 never joins the first all-gather: rank 0's forward raises, naming the collective, its
    rank and group, and the time it waited (FSDP_TIMEOUT_S)."""
    model = shard(build("plain"))
    if fsdpcpp.rank() == 1:
        time.sleep(60)  # ended by the launcher once rank 0 has failed
        return
    loss_of(model, my_rows(batch(0)))


def case_rank_raises(args):
    """After a step, rank 1 raises an ordinary exception (a bug in the script) while rank 0 goes on
    into the next forward's all-gather: the job ends within seconds, naming rank 1 and its error,
    not at the collective timeout."""
    model = shard(build("plain"))
    opt = optimizer_for(model)
    sharded_step(model, opt, 0)
    if fsdpcpp.rank() == 1:
        print(f"rank 1 raises at {time.time():.3f}", flush=True)
        raise ValueError("a bug in rank 1's own code")
    sharded_step(model, opt, 1)


def case_divergent_forward(args):
    """Rank-dependent control flow: rank 1 skips the second block's forward. Every rank must fail
    naming the sharded module its collective was moving, not hang or train on."""
    model = shard(build("plain"))
    if fsdpcpp.rank() == 1:
        del model.layers[1]
    print(f"rank {fsdpcpp.rank()} diverges at {time.time():.3f}", flush=True)
    for step in range(2):
        loss_of(model, my_rows(batch(step))).backward()


def case_generate(args):
    """transformers' generate on a sharded Llama, each rank its own prompt and length (so the ranks
    finish at different steps): generate syncs them as under FSDP2 (synced_gpus, detected), and
    each rank's tokens equal the unsharded model's."""
    reference = build("llama").eval()
    model = shard(build("llama")).eval()
    prompt = my_rows(batch(0))[:1, :4 + fsdpcpp.rank()]
    new_tokens = 3 + 3 * fsdpcpp.rank()
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
        got = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True)
    assert torch.equal(got, expected), f"rank {fsdpcpp.rank()}: {got.tolist()} vs {expected.tolist()}"


def case_beside_process_group(args):
    """A script that made its torch.distributed process group first, as FSDP2 scripts do: init()
    joins the same ranks beside it, and training matches the reference."""
    import torch.distributed as dist
    os.environ.setdefault("RANK", os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ.setdefault("WORLD_SIZE", os.environ["OMPI_COMM_WORLD_SIZE"])
    os.environ.setdefault("LOCAL_RANK", os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    dist.init_process_group("gloo")
    fsdpcpp.init()
    assert (fsdpcpp.rank(), fsdpcpp.world_size()) == (dist.get_rank(), dist.get_world_size())
    ref = Reference("plain", 2)
    model = shard(build("plain"))
    losses, _ = train_sharded(model, 2)
    check_parity(ref, losses, model, "plain beside a gloo process group")
    dist.destroy_process_group()


def case_plan(args):
    """The memory-budget planner on the user's own step (5 training steps a call): a budget under
    the smallest refused, naming it, the model training as before; the smallest budget planned
    with recomputation, which runs (the block's first part twice a step) and stays under the
    budget; every step, the planner's included, at parity (with --bf16, bfloat16 compute: equal to
    bf16_reference bit for bit, as recomputing changes no arithmetic)."""
    accum = args.accum
    mp = fsdpcpp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    assert not mp or (accum == 1 and fsdpcpp.world_size() <= 2), "--bf16: one micro-batch, 1 or 2 ranks (bf16_reference)"
    model = shard(build(args.model), mp=mp)
    opt = optimizer_for(model)
    losses = []

    def train_step():
        losses.append(sharded_step(model, opt, len(losses), accum=accum))

    planner = dict(micro_batches=accum, reduce_every_micro_batch=True, verbose=False)
    try:
        fsdpcpp.plan_memory_budget(model, train_step, 1 << 10, **planner)
        raise AssertionError("a 1 KiB budget was not refused")
    except fsdpcpp.BudgetTooSmall as refused:
        assert "fsdpcpp.plan_memory_budget(" in str(refused) and "smallest" in str(refused), str(refused)
        smallest = refused.smallest_budget_bytes
    assert not any(type(m).__name__.startswith("Recomputed") for m in model.modules()), "the refusal left recomputation on"
    first = blocks_of(model)[0]
    first_path = next(name for name, m in model.named_modules() if m is first)
    first._fsdpcpp.group.set_prefetch_depth(3)  # a module's own depth: put back by an unapplied plan
    roomy = fsdpcpp.plan_memory_budget(model, train_step, 1 << 40, apply=False, **planner)
    assert first._fsdpcpp.group.prefetch_depth == 3, "the unapplied plan left block 0's own prefetch depth changed"
    # Recomputation matters on this model: the schedule an unbounded budget takes, where it recomputes
    # nothing, does not fit the least budget (which is the least peak plus the 5% margin). Not a
    # wider factor: that schedule is the fastest on a CPU whose timings vary, and it may gather
    # less ahead (prefetch 0: 8% above the least budget in one CI run).
    assert roomy.recomputed or roomy.peak_bytes > smallest, f"recomputation must matter on this model: {smallest} vs {roomy}"
    # The least budget that fits: only the schedules of the least predicted peak meet it, and those
    # recompute. (A budget halfway to the fastest schedule's peak may fit a schedule that gathers
    # less ahead instead; and on a busy CPU the fastest schedule may itself recompute a block, where
    # the step's tail waits for the reduce-scatters. That an unbounded budget recomputes nothing
    # where recomputing costs time is tests/lib/simulator_planner_tests.cpp's
    # Planner.UnboundedBudgetTakesTheFastestWithoutCheckpointing.)
    budget = smallest
    plan = fsdpcpp.plan_memory_budget(model, train_step, budget, **planner)
    assert plan.recomputed and plan.peak_bytes <= budget, plan
    assert first._fsdpcpp.group.prefetch_depth == plan.prefetch_depths.get(first_path, -1), (plan.prefetch_depths,
                                                                                            first_path)
    calls = []
    next(first.children()).register_forward_pre_hook(lambda *_: calls.append(1))
    train_step()
    fsdpcpp.reset_peak_allocated()
    calls.clear()
    train_step()
    measured = fsdpcpp.allocated_bytes()["peak"]
    recomputed_block0 = "layers.0" in plan.recomputed or "model.layers.0" in plan.recomputed
    assert len(calls) == accum * (2 if recomputed_block0 else 1), (calls, plan.recomputed)
    assert measured <= budget, f"the planned step peaked at {measured} bytes, over the budget {budget}: {plan}"
    what = f"{args.model} planned for {budget} bytes ({plan.description}), {len(losses)} steps with the planner's"
    if mp:
        ref_losses, ref_params = bf16_reference(args.model, len(losses), fsdpcpp.world_size())
        full = fsdpcpp.get_model_state_dict(model)
        worst = max((full[n] - p).abs().max().item() for n, p in ref_params.items())
        assert losses == ref_losses and worst == 0, f"{what}: losses {losses} vs {ref_losses}, parameters differ by {worst:.3g}"
    else:
        check_parity(Reference(args.model, len(losses), accum=accum), losses, model, what)
    if fsdpcpp.rank() == 0:
        print(f"plan: smallest budget {smallest} bytes; {plan}; measured peak {measured}")


def check_float8_runs(tested, expected, plain):
    """Runs as (losses, parameters): `tested` equals `expected` bit for bit, and differs from the
    float32 model's `plain` run by float8's rounding only."""
    assert tested[0] == expected[0], f"losses {tested[0]} vs {expected[0]}"
    for i, (a, b) in enumerate(zip(tested[1], expected[1])):
        assert torch.equal(a, b), f"parameter {i} differs"
    assert tested[0] != plain[0], "the float8 model's losses equal the float32 one's: float8 did not run"
    # e4m3 rounds each operand by at most 2^-4 relative; a loss of these tiny models moves far less.
    assert all(abs(a - b) < 0.05 * b for a, b in zip(tested[0], plain[0])), (tested[0], plain[0])


def case_float8(args):
    """fsdpcpp.float8 on a model nobody here wrote. Gathering the converted weights in float8 gives
    the run of gathering them in float32 and casting after, bit for bit (the same values cast with
    the same power-of-two scale, from the amax over all ranks); each weight's last row is made its
    largest (a rank's own amax would give another scale) and before step 2 every weight doubles (a
    scale not refreshed from the weights would saturate). The float8 linears really run: the losses
    differ from the float32 model's, by float8's rounding only. Built on meta (FSDP2's recipe),
    converted, sharded and loaded with the same weights, the run is the same bit for bit. And
    converting after fully_shard is refused."""
    from fsdpcpp._dtensor import managed
    from fsdpcpp.float8 import Float8Linear, convert_to_float8_training

    def converted(model, float8, all_gather=True):
        if float8:
            convert_to_float8_training(model, enable_fsdp_float8_all_gather=all_gather,
                                       module_filter_fn=lambda mod, fqn: fqn not in ("lm_head", "head"))
        return model, [m for m in model.modules() if isinstance(m, nn.Linear) and m.in_features % 16 == 0]

    def run(float8, all_gather=True, meta=False):
        model, linears = converted(build(args.model), float8, all_gather)
        with torch.no_grad():
            for m in linears:
                m.weight[-1].mul_(8)
        if meta:  # FSDP2's recipe: built on meta, converted, sharded, given its rows, then these weights
            weights = model.state_dict()
            with torch.device("meta"):
                model, linears = converted(MODELS[args.model](), float8, all_gather)
        float8_linears = [m for m in linears if isinstance(m, Float8Linear)]
        assert float8 == bool(float8_linears), "convert_to_float8_training converted nothing"
        shard(model)
        if meta:
            model.to_empty(device=fsdpcpp.device())
            fsdpcpp.set_model_state_dict(model, weights)
        assert all(fsdpcpp._C.float8_all_gather_enabled(managed(m.weight)) == all_gather for m in float8_linears)
        opt = optimizer_for(model)
        losses = train_sharded(model, 2, optimizer=opt)[0]
        with torch.no_grad():
            for m in linears:
                m.weight.mul_(2)  # the shards, between steps
        losses += train_sharded(model, 2, first_step=2, optimizer=opt)[0]
        return losses, [p.detach().clone() for p in model.parameters()]

    gathered, cast_after, plain = run(True, True), run(True, False), run(False)
    check_float8_runs(gathered, cast_after, plain)
    if args.model == "plain":  # no buffer outside its state dict, which to_empty would leave unset
        check_float8_runs(run(True, True, meta=True), gathered, plain)
    model = shard(build(args.model))
    expect_error(ValueError, "before fully_shard", lambda: convert_to_float8_training(model))
    if fsdpcpp.rank() == 0:
        print(f"float8: losses {gathered[0]} (float32 {plain[0]})")


def case_float8_tied(args):
    """An output head tied to the token embedding (transformers' GPT-2), converted with float8
    all-gather asked for: the head runs in float8, but its weight, which the embedding reads too,
    is gathered in float32 and cast in the linear (gathered in float8 it would read as NaN in the
    embedding). So the run equals the one converted with float8 all-gather off, bit for bit, and
    differs from the float32 model's by float8's rounding only."""
    from fsdpcpp._dtensor import managed
    from fsdpcpp.float8 import Float8Linear, convert_to_float8_training

    def run(convert, all_gather=True):
        model = build("gpt2")
        if convert:
            convert_to_float8_training(model, enable_fsdp_float8_all_gather=all_gather)
            head = model.lm_head
            assert isinstance(head, Float8Linear) and head.weight is model.transformer.wte.weight
        shard(model)
        if convert:
            assert not fsdpcpp._C.float8_all_gather_enabled(managed(head.weight)), "the tied head is gathered in float8"
        losses = train_sharded(model, 3)[0]
        return losses, [p.detach().clone() for p in model.parameters()]

    asked, off, plain = run(True), run(True, all_gather=False), run(False)
    check_float8_runs(asked, off, plain)
    if fsdpcpp.rank() == 0:
        print(f"float8_tied: losses {asked[0]} (float32 {plain[0]})")


def case_float8_compile(args):
    """Float8Linear under torch.compile, each block compiled before fully_shard (as torchtitan
    does). Dynamo cannot trace the C++ float8 product, so each one is a graph break and the block
    compiles in pieces around it. The run is then the eager float8 run but for float32
    reassociation in the compiled pieces, which moves few float8 roundings: it lies closer to the
    eager float8 run than float8's rounding puts that run from the float32 model's."""
    from torch._dynamo.utils import counters
    from fsdpcpp.float8 import convert_to_float8_training

    def run(float8, compiled):
        model = build(args.model)
        if float8:
            convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn not in ("lm_head", "head"))
        if compiled:
            for block in blocks_of(model):
                block.compile()
        shard(model)
        return train_sharded(model, 3)[0]

    eager, plain = run(True, False), run(False, False)
    counters.clear()
    compiled = run(True, True)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert any("float8_linear" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
    assert compiled != plain, "the compiled model's losses equal the float32 one's: float8 did not run"
    assert all(abs(c - e) <= abs(e - p) for c, e, p in zip(compiled, eager, plain)), (compiled, eager, plain)
    if fsdpcpp.rank() == 0:
        print(f"float8_compile: losses {compiled} (eager {eager}, float32 {plain})")


CASES = {"rank_raises": case_rank_raises, "another_mesh": case_another_mesh, "group_member_skipped": case_group_member_skipped, "torch_calls": case_torch_calls, "optimizer_in_backward": case_optimizer_in_backward, "meta_init": case_meta_init, "divergent_forward": case_divergent_forward,
         "generate": case_generate, "float8": case_float8, "float8_tied": case_float8_tied, "float8_compile": case_float8_compile, "plan": case_plan, "parity": case_parity, "timeout": case_timeout, "beside_process_group": case_beside_process_group, "mixed_precision": case_mixed_precision, "save": case_save, "resume": case_resume,
         "errors": case_errors, "hf_roundtrip": case_hf_roundtrip, "compile": case_compile, "trace": case_trace,
         **TOUCH_CASES}


def check_gloo_threads_joined():
    """At exit, after fsdpcpp destroyed the process groups: a gloo worker thread still running would
    outlive the interpreter, where one dropping a Python tensor aborts the process."""
    tasks = f"/proc/{os.getpid()}/task"
    left = 0
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as name:
                left += name.read().strip() == "pt_gloo_runloop"
        except FileNotFoundError:  # ended meanwhile
            pass
    print(f"rank {fsdpcpp.rank()}: {left} gloo worker threads left at exit", flush=True)
    if left:
        os._exit(3)  # an exception in an exit handler would not change the exit status


def parse_runs(words):
    """The runs a job makes, one after another in the same processes: `CASE [options]` runs
    separated by `--then` (the tests share one start-up, most of a small case's time, between the
    runs of a test that need the same rank count)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--model", default="plain", choices=sorted(MODELS))
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 reduce (plan)")
    parser.add_argument("--optimizer-before", action="store_true")
    parser.add_argument("--checkpointed", action="store_true")
    parser.add_argument("--keep-after-forward", action="store_true")
    parser.add_argument("--checkpoint-calls", action="store_true")
    parser.add_argument("--lr-scale", type=float, default=1.0)
    parser.add_argument("--dir", default="")
    parser.add_argument("--runtime", default="fsdpcpp", choices=["fsdp2", "fsdpcpp"])
    parser.add_argument("--ram-efficient", action="store_true", help="accelerate: cpu_ram_efficient_loading")
    parser.add_argument("--load", default="broadcast", choices=["broadcast", "safetensors"], help="meta_init")
    parser.add_argument("--replicas", type=int, default=1, help="torch_calls: HSDP's replicas (a 2-D mesh)")
    parser.add_argument("--tp", type=int, default=1, help="torch_calls: tensor parallelism's degree (the mesh's last dim)")
    parser.add_argument("--resume-from", default="", help="torch_calls: a DCP checkpoint at step 2")
    parser.add_argument("--port", default="29531")
    parser.add_argument("--seq", type=int, default=common.SEQ, help="tokens a row (a GPU's fixed workspaces dwarf 16)")
    parser.add_argument("--exit-threads", action="store_true",
                        help="after every exit handler, no gloo worker thread may be left (pytorch#190489)")
    runs, words = [], list(words)
    while True:
        cut = words.index("--then") if "--then" in words else len(words)
        runs.append(parser.parse_args(words[:cut]))
        if cut == len(words):
            break
        words = words[cut + 1:]
    if len(runs) > 1 and any(args.case == "beside_process_group" for args in runs):
        parser.error("beside_process_group makes its own process group: run it alone")
    if any(args.exit_threads for args in runs) and any(args.runtime == "fsdp2" for args in runs):
        parser.error("--exit-threads checks fsdpcpp's exit: FSDP2's state keeps its groups' threads (run it apart)")
    return runs


def main():
    runs = parse_runs(sys.argv[1:])  # every run's options checked before any work
    if any(args.exit_threads for args in runs):
        atexit.register(check_gloo_threads_joined)  # registered first: runs after fsdpcpp's
    torch.set_num_threads(1)
    if runs[0].case != "beside_process_group":
        fsdpcpp.init()  # CPU ranks: MPI under mpirun, gloo under torchrun; GPUs (fsdp-run --gpu): NCCL
        if fsdpcpp.device().type == "cuda" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            probe = torch.empty(1 << 20, device=fsdpcpp.device())
            segments = [s for s in torch.cuda.memory_snapshot() if s["device"] == fsdpcpp.device().index]
            assert segments and all(s["is_expandable"] for s in segments), "init() left expandable segments off"
            del probe
    for i, args in enumerate(runs):
        if i:  # the last run's models freed, and what it wrote (a checkpoint the next resumes) complete on every rank
            gc.collect()
            fsdpcpp.all_reduce(torch.zeros(1, device=fsdpcpp.device()))
            if fsdpcpp.rank() == 0:  # test_fsdpcpp.py's shared jobs tell from it which runs passed
                print(f"cases: run {i} of {len(runs)} passed on every rank", flush=True)
        common.SEQ = args.seq
        CASES[args.case](args)


if __name__ == "__main__":
    main()
