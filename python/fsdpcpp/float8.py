"""Float8 training of any model's linear layers, run by fsdp.cpp's float8_linear (C++,
include/fsdp/float8.h): the counterpart of torchao.float8's ``convert_to_float8_training``, with
float8 all-gather under ``fully_shard`` on by default.

    from fsdpcpp.float8 import convert_to_float8_training
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)

Each converted ``nn.Linear`` runs its forward and both gradients' matrix products on the float8
tensor cores (compute capability 8.9+; CPU ranks emulate them) with dynamic power-of-two scales:
"tensorwise" (one scale per tensor; e4m3 inputs and weights, e5m2 output gradients) or "rowwise"
(one scale per row, e4m3). The weights, gradients and optimizer state keep their dtypes.

With ``enable_fsdp_float8_all_gather`` (tensorwise only) fully_shard all-gathers each converted
weight as float8, one byte per element, with a scale from its amax over all ranks that the runtime
refreshes at the start of every forward of the root: nothing like torchao's
``precompute_float8_dynamic_scale_for_fsdp`` is needed. While its module is unsharded such a
weight's own value is not materialised (it reads as NaN): only its Float8Linear may use it. So
``convert_to_float8_training`` gathers a weight that another module also holds (an output head
tied to the token embedding, as in GPT-2 and Llama 3.2) in its compute dtype and casts it in the
linear, as with ``enable_fsdp_float8_all_gather=False``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from . import _C
from ._dtensor import managed
from ._fully_shard import FLOAT8_ALL_GATHER

RECIPES = ("tensorwise", "rowwise")


def _checked_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"fsdpcpp.float8: recipe must be one of {RECIPES}, not {recipe!r}")
    return recipe


class Float8Linear(nn.Linear):
    """nn.Linear whose matrix products (forward, input and weight gradients) run in float8 by
    `recipe`; the bias is added in the input's dtype. On GPUs in_features, out_features and the
    input's rows (the product of its leading sizes) must be multiples of 16."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: str = "tensorwise"):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = _checked_recipe(recipe)

    @classmethod
    def from_float(cls, linear: nn.Linear, recipe: str = "tensorwise",
                   enable_fsdp_float8_all_gather: bool = True) -> "Float8Linear":
        """A Float8Linear holding `linear`'s own parameters (the same tensors). With
        enable_fsdp_float8_all_gather its weight is marked for float8 all-gather, after which
        nothing but this linear may read it while unsharded: pass False for a weight that other
        code reads too (convert_to_float8_training decides this by itself)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        if enable_fsdp_float8_all_gather and recipe == "tensorwise":
            # Marked for the runtime by fully_shard (FLOAT8_ALL_GATHER): a mark on the tensor now
            # would hold a weak reference to it, and fully_shard could not place a weight built on
            # meta (swap_tensors refuses a tensor with one).
            setattr(new.weight, FLOAT8_ALL_GATHER, True)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _C.float8_linear(x, self.weight, self.recipe)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def convert_to_float8_training(module: nn.Module, *, recipe: str = "tensorwise",
                               enable_fsdp_float8_all_gather: bool = True,
                               module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replaces, in place, every nn.Linear under `module` that module_filter_fn(linear, its
    qualified name) accepts (all by default) and whose in_features and out_features are multiples
    of 16 (the float8 GEMMs' rule; others stay as they are) by a Float8Linear holding the same
    parameters. With enable_fsdp_float8_all_gather, each converted weight that no other module
    holds is gathered in float8; a shared one (a tied output head) is gathered in its compute dtype,
    because the other module reads its value. Call it before fully_shard (float8 all-gather is
    decided when a group is made) and before making the optimizer or anything else that keeps the
    modules. Returns `module`."""
    _checked_recipe(recipe)
    params = list(module.named_parameters())
    sharded = [name for name, param in params if _C.is_sharded_parameter(managed(param))]
    if sharded:
        raise ValueError(f"fsdpcpp.float8: {sharded[0]!r} is already sharded: call convert_to_float8_training "
                         "before fully_shard")
    for device in {param.device for _, param in params if param.device.type == "cuda"}:
        _C.check_float8_device(str(device))
    # How many modules hold each parameter: a weight held by another module too (an embedding it
    # is tied to) would read as NaN there while gathered in float8.
    holders = {}
    for holder in module.modules():
        for param in holder.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1

    def convert(parent: nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            fqn = prefix + name
            if (type(child) is nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0
                    and (module_filter_fn is None or module_filter_fn(child, fqn))):
                all_gather = enable_fsdp_float8_all_gather and holders[id(child.weight)] == 1
                setattr(parent, name, Float8Linear.from_float(child, recipe, all_gather))
            else:
                convert(child, fqn + ".")

    convert(module, "")
    return module
