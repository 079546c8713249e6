"""What users do to a sharded model's parameters between fully_shard and the step, each under
--runtime fsdp2 or fsdpcpp (only fully_shard differs), trained at parity with a single-process
reference that makes the same change: loading (load_state_dict with assign=True as PyTorch's FSDP2
example and accelerate's memory-efficient loading do, with swap_tensors, strict=False with keys
missing), setattr of new parameters, freezing, an evaluation between steps, an optimizer reloaded,
an explicit unshard() before forward, parametrizations made before sharding. What fsdpcpp refuses
(a dtype change, a parameter removed, parametrized or tied to another after sharding) must raise
naming the parameter and leave the model training as before.

    python cases.py touches --runtime R --dir DIR    rank 0 writes DIR/touches-R.json
    python cases.py accelerate --runtime R --model M [--ram-efficient]
"""

import json
import os
from types import SimpleNamespace

import torch
from torch import nn

import fsdpcpp
from common import (Reference, batch, build, check_torch_loop, expect_error, fully_shard_of, my_rows,
                    optimizer_for, torch_loop)
from models import MODELS, blocks_of, loss_of

STEPS, CLIP = 3, 0.5


def sharded(fully_shard, mesh, model=None):
    """The plain Llama (or `model`), each block and then the root sharded."""
    model = build("plain") if model is None else model
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def distributed(value, like):
    """`value` (a full tensor) laid out as the sharded parameter `like`."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.detach().to(fsdpcpp.device()), like.device_mesh, like.placements)


def loaded_with_assign(fully_shard, mesh):
    """PyTorch's FSDP2 example: built on meta, sharded, each full tensor distributed as its
    parameter is and loaded with load_state_dict(strict=False, assign=True); optimizer after."""
    with torch.device("meta"):
        model = sharded(fully_shard, mesh, MODELS["plain"]())
    full = build("plain").state_dict()
    state = {name: nn.Parameter(distributed(full[name], p)) for name, p in model.state_dict().items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model, optimizer_for(model), None, Reference("plain", STEPS, clip=CLIP)


def loaded_by_swapping(fully_shard, mesh):
    """The same load with torch.__future__'s swap_module_params_on_conversion: load_state_dict
    swaps the new contents into the parameter objects instead of replacing them."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return loaded_with_assign(fully_shard, mesh)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def halve_out_and_double_norm(model):
    with torch.no_grad():
        model.layers[0].out.weight.mul_(0.5)
        model.layers[1].attn_norm.mul_(2)


def replaced_by_setattr(fully_shard, mesh):
    """New DTensor parameters set after sharding, before the optimizer: layer 0's output projection
    by setattr, layer 1's attention norm by register_parameter."""
    model = sharded(fully_shard, mesh)
    values = build("plain")
    halve_out_and_double_norm(values)
    layers = model.layers
    layers[0].out.weight = nn.Parameter(distributed(values.layers[0].out.weight, layers[0].out.weight))
    layers[1].register_parameter("attn_norm", nn.Parameter(distributed(values.layers[1].attn_norm, layers[1].attn_norm)))
    return model, optimizer_for(model), None, Reference("plain", STEPS, clip=CLIP, prepare=halve_out_and_double_norm)


def loaded_full_tensors_with_assign(fully_shard, mesh):
    """load_state_dict(full_state_dict, assign=True) of plain full tensors after sharding: fsdpcpp
    copies each rank's rows in and keeps its DTensors (under FSDP2 the module would hold the plain
    tensors)."""
    model = sharded(fully_shard, mesh)
    values = build("plain")
    halve_out_and_double_norm(values)
    model.load_state_dict(values.state_dict(), assign=True)
    return model, optimizer_for(model), None, Reference("plain", STEPS, clip=CLIP, prepare=halve_out_and_double_norm)


HALF = ("embed.weight", "layers.0.qkv.weight", "layers.1.down.weight", "norm")


def halve_some(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in HALF:
                p.mul_(0.5)


def loaded_in_part(fully_shard, mesh):
    """load_state_dict(strict=False) of some parameters as DTensors (copied in): the others keep
    their values and are reported missing."""
    model = sharded(fully_shard, mesh)
    values = build("plain")
    halve_some(values)
    own = model.state_dict()
    result = model.load_state_dict({name: distributed(values.state_dict()[name], own[name]) for name in HALF},
                                   strict=False)
    assert sorted(result.missing_keys) == sorted(set(own) - set(HALF)), result
    return model, optimizer_for(model), None, Reference("plain", STEPS, clip=CLIP, prepare=halve_some)


def freeze_embedding(model, step):
    if step == 1:
        model.embed.weight.requires_grad_(False)


def frozen_after_a_step(fully_shard, mesh):
    """requires_grad_(False) on the token embedding before step 1."""
    model = sharded(fully_shard, mesh)
    return (model, optimizer_for(model), lambda step: freeze_embedding(model, step),
            Reference("plain", STEPS, clip=CLIP, before_step=freeze_embedding))


def evaluated_between_steps(fully_shard, mesh):
    """model.eval(), a forward under no_grad, model.train() before every step but the first."""
    model = sharded(fully_shard, mesh)

    def evaluate(step):
        if step:
            model.eval()
            with torch.no_grad():
                loss_of(model, build_batch(step + 100))
            model.train()
    return model, optimizer_for(model), evaluate, Reference("plain", STEPS, clip=CLIP)


def build_batch(step):
    return my_rows(batch(step))


def optimizer_reloaded(fully_shard, mesh):
    """Before step 2 a new optimizer takes the old one's state_dict()."""
    model = sharded(fully_shard, mesh)
    state = {"opt": optimizer_for(model)}

    def reload(step):
        if step == 2:
            fresh = optimizer_for(model)
            fresh.load_state_dict(state["opt"].state_dict())
            state["opt"] = fresh
            return model, fresh
    return model, state["opt"], reload, Reference("plain", STEPS, clip=CLIP)


def unsharded_by_hand(fully_shard, mesh):
    """FSDP2's way to prefetch by hand: unshard(async_op=True) of every block before each forward,
    then wait() on each handle."""
    model = sharded(fully_shard, mesh)

    def unshard(step):
        handles = [block.unshard(async_op=True) for block in blocks_of(model)]
        for handle in handles:
            handle.wait()
    return model, optimizer_for(model), unshard, Reference("plain", STEPS, clip=CLIP)


def compiled_root(fully_shard, mesh):
    """torch.compile of the whole sharded model (the root's call), after fully_shard (on CPU ranks
    dynamo and AOTAutograd without inductor's code generation, which would take a minute)."""
    model = sharded(fully_shard, mesh)
    backend = "inductor" if fsdpcpp.device().type == "cuda" else "aot_eager"  # CPU ranks: no code generation
    return torch.compile(model, backend=backend), optimizer_for(model), None, Reference("plain", STEPS, clip=CLIP)


def weight_norm_on_out(model):
    for block in blocks_of(model):
        torch.nn.utils.parametrizations.weight_norm(block.out)


def parametrized_before_sharding(fully_shard, mesh):
    """weight_norm's parametrization of each block's output projection, made before fully_shard."""
    model = build("plain")
    weight_norm_on_out(model)
    model = sharded(fully_shard, mesh, model)
    return model, optimizer_for(model), None, Reference("plain", STEPS, clip=CLIP, prepare=weight_norm_on_out)


def accelerated(model_name, runtime, ram_efficient):
    """accelerate's FSDP2 path (fsdp2_prepare_model, which Accelerator.prepare and so transformers'
    Trainer run) on --runtime fsdp2, or on fsdpcpp through its opt-in fsdpcpp.use_as_fsdp2():
    accelerate's auto-wrap of each decoder layer, the final norm and output head as one group
    (a list; the token embedding joins it where the head is tied to it), then the root.
    ram_efficient: the plugin's cpu_ram_efficient_loading, which moves the model to meta, shards
    it there and loads rank 0's weights with load_state_dict(assign=True), tying the head again.
    Returns the model and an optimizer made before prepare() (on GPUs) or after."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    if runtime == "fsdpcpp":
        fsdpcpp.use_as_fsdp2()
    layer = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}[model_name]
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[layer],
                                            cpu_ram_efficient_loading=ram_efficient)
    model = build(model_name)
    if fsdpcpp.device().type == "cuda":
        # The whole Accelerator, launched as torchrun launches it (accelerate reads its variables):
        # prepare() shards the model and moves the optimizer made before it onto the shards.
        from accelerate import Accelerator
        os.environ.update(RANK=str(fsdpcpp.rank()), WORLD_SIZE=str(fsdpcpp.world_size()),
                          LOCAL_RANK=str(fsdpcpp.device().index))
        accelerator = Accelerator(fsdp_plugin=plugin)
        assert accelerator.is_fsdp2, f"accelerate chose {accelerator.distributed_type}, not FSDP2"
        model, opt = accelerator.prepare(model, optimizer_for(model))
    else:
        # What fsdp2_prepare_model reads of its Accelerator: on CPU ranks an Accelerator does not
        # take FSDP (accelerate enables it for GPU-like devices only), so these stand in for one.
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                      is_main_process=fsdpcpp.rank() == 0, device=fsdpcpp.device())
        model = fsdp2_prepare_model(accelerator, model)
        opt = optimizer_for(model)
    import torch.distributed.fsdp as fsdp2  # fsdpcpp's names after use_as_fsdp2()
    assert isinstance(model.get_output_embeddings(), fsdp2.FSDPModule), "accelerate left the output head unsharded"
    return model, opt


def case_accelerate(args):
    """accelerated() under --runtime, then torch's loop at parity with a single-process reference."""
    fully_shard_of(args.runtime)  # the process group
    ref = Reference(args.model, STEPS, clip=CLIP)
    model, opt = accelerated(args.model, args.runtime, args.ram_efficient)
    model, losses, norms = torch_loop(model, opt, STEPS, CLIP)
    check_torch_loop(f"accelerate: {args.model} on {args.runtime}"
                     f"{' with cpu_ram_efficient_loading' if args.ram_efficient else ''}", ref, model, losses, norms)


def loaded_by_accelerate(fully_shard, mesh):
    """accelerate's cpu_ram_efficient_loading on transformers' GPT-2 (a tied head)."""
    runtime = "fsdp2" if fully_shard.__module__.startswith("torch") else "fsdpcpp"
    model, opt = accelerated("gpt2", runtime, ram_efficient=True)
    return model, opt, None, Reference("gpt2", STEPS, clip=CLIP)


# Refused by fsdpcpp, named, and undone (FSDP2 follows some of them, or breaks): each returns the
# model after the refusal, which must then train as if nothing had happened.
def converted_to_float64(fully_shard, mesh):
    model = sharded(fully_shard, mesh)
    expect_error(ValueError, "'layers.0.qkv.weight' became torch.float64; the shards are torch.float32",
                 lambda: model.to(torch.float64))
    return model


def tied_after_sharding(fully_shard, mesh):
    model = sharded(fully_shard, mesh)
    model.head.weight = model.embed.weight
    expect_error(ValueError, "'head.weight' was replaced by another sharded parameter",
                 lambda: loss_of(model, build_batch(0)))
    return model


def parametrized_after_sharding(fully_shard, mesh):
    model = sharded(fully_shard, mesh)
    try:
        torch.nn.utils.parametrizations.weight_norm(model.layers[0].out)
    except Exception as e:  # torch itself may refuse a DTensor here: an error either way, never silence
        return f"torch: {type(e).__name__}: {e}"
    expect_error(ValueError, "'layers.0.out.weight' was removed from its module",
                 lambda: loss_of(model, build_batch(0)))
    return None


def set_to_a_full_tensor(fully_shard, mesh):
    model = sharded(fully_shard, mesh)
    model.layers[0].out.weight = nn.Parameter(torch.zeros(32, 32, device=fsdpcpp.device()))
    expect_error(ValueError, "'layers.0.out.weight' was replaced by a plain tensor",
                 lambda: loss_of(model, build_batch(0)))
    return model


def deleted(fully_shard, mesh):
    model = sharded(fully_shard, mesh)
    del model.layers[1].down.weight
    expect_error(ValueError, "'layers.1.down.weight' was removed from its module", lambda: loss_of(model, build_batch(0)))
    return None


TRAINED = {"assign": loaded_with_assign, "assign_by_swap": loaded_by_swapping, "setattr": replaced_by_setattr,
           "load_in_part": loaded_in_part, "freeze": frozen_after_a_step, "eval": evaluated_between_steps,
           "optimizer_reload": optimizer_reloaded, "unshard": unsharded_by_hand, "compiled_root": compiled_root,
           "parametrized_before": parametrized_before_sharding, "accelerate_ram_efficient": loaded_by_accelerate}
TRAINED_ON_FSDPCPP = {"assign_full_tensors": loaded_full_tensors_with_assign}
REFUSED = {"to_float64": converted_to_float64, "tie_after": tied_after_sharding, "set_full_tensor": set_to_a_full_tensor,
           "parametrize_after": parametrized_after_sharding, "delete": deleted}


def case_touches(args):
    fully_shard, mesh, _ = fully_shard_of(args.runtime)
    results = {}
    trained = dict(TRAINED, **(TRAINED_ON_FSDPCPP if args.runtime == "fsdpcpp" else {}))
    for name, touch in trained.items():
        model, opt, before_step, ref = touch(fully_shard, mesh)
        model, losses, norms = torch_loop(model, opt, STEPS, CLIP, before_step=before_step)
        check_torch_loop(f"touch '{name}' on {args.runtime}", ref, model, losses, norms)
        results[name] = {"losses": losses, "norms": norms, "bound": ref.relative}
    if args.runtime == "fsdpcpp":
        for name, touch in REFUSED.items():
            model = touch(fully_shard, mesh)
            if isinstance(model, nn.Module):
                ref = Reference("plain", STEPS, clip=CLIP)
                model, losses, norms = torch_loop(model, optimizer_for(model), STEPS, CLIP)
                check_torch_loop(f"after the refused '{name}'", ref, model, losses, norms)
            results[name] = {"refused": True, "note": model if isinstance(model, str) else ""}
    if fsdpcpp.rank() == 0:
        with open(os.path.join(args.dir, f"touches-{args.runtime}.json"), "w") as out:
            json.dump(results, out)


TOUCH_CASES = {"touches": case_touches, "accelerate": case_accelerate}
