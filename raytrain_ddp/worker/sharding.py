"""FSDP2 (scaling.strategy=fsdp): the model sharded across the workers, and its sharded checkpoints.

`shard` applies torch's `fully_shard` to each of the model's repeated blocks, then to the root: each
worker holds 1/N of every parameter, its gradient and its optimizer state, and a block's parameters
are gathered whole only for its forward and backward. The module is sharded in place: `model` stays
what is built, evaluated and saved (its parameters become DTensors, its state_dict keys unchanged).

Under FSDP every forward pass is a collective: every rank evaluates and generates in lockstep
(`step.evaluate`, `loop._generate`).

A sharded checkpoint is torch.distributed.checkpoint's (DCP): every rank writes its own shards of the
model and the optimizer state (`save`, into checkpoint/format.py's SHARDS_DIR), and a load reshards
them onto however many ranks load it (`load`: a run resumed on another number of workers).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from raytrain_ddp.config.recipe import Recipe
from raytrain_ddp.config.schema import Config

# torch's FSDP2, DTensor and DCP are imported where they are used: 0.8 s of every worker's start, for
# the runs that shard only.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def blocks(recipe: Recipe, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one, before the root: the recipe's `shard_blocks(model)` (module
    classes, or modules), else the classes a Hugging Face model names in `_no_split_modules` (its
    decoder layers, as accelerate's FSDP wrapping reads them), else none: the root alone."""
    named = recipe.shard_blocks(model) if recipe.shard_blocks is not None else None
    if named is None:
        kinds = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
        return [m for m in model.modules() if m is not model and type(m).__name__ in kinds]
    named = list(named)
    classes = tuple(c for c in named if isinstance(c, type))
    listed = {id(m) for m in named if isinstance(m, torch.nn.Module)}
    return [m for m in model.modules() if m is not model and (isinstance(m, classes) or id(m) in listed)]


def shard(model: torch.nn.Module, recipe: Recipe, config: Config, device: torch.device) -> torch.nn.Module:
    """Each of `model`'s `blocks` sharded with `fully_shard`, then the root, in place, onto `device`.
    train.precision=bf16 gathers parameters in bf16 and reduces gradients in fsdp.reduce_dtype; the
    sharded parameters and the optimizer keep the dtype the recipe built them in.

    Not moved to the device first: `fully_shard` moves each block's parameters and buffers as it shards
    them (the root's call: all that is left), so a GPU holds one whole block at a time, never the whole
    model (a 70B model's 140 GB of bf16 weights would not fit one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    settings = {
        "mesh": init_device_mesh(device.type, (torch.distributed.get_world_size(),)),
        "reshard_after_forward": config.fsdp.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[config.fsdp.reduce_dtype])
        if config.train.precision == "bf16"
        else MixedPrecisionPolicy(),
    }
    if config.fsdp.cpu_offload:
        settings["offload_policy"] = CPUOffloadPolicy()
    for block in blocks(recipe, model):
        fully_shard(block, **settings)
    # The root's parameters stay gathered from its forward to its backward, as torch's default has it:
    # a recipe may use them between the two (chat_sft applies the output layer in its loss).
    fully_shard(model, **(settings | {"reshard_after_forward": False}))
    for module in model.modules():  # transformers' generate then keeps every rank stepping until all are done
        module._is_fsdp_managed_module = True
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing was sharded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Write this rank's shards of the model's trained parameters and of the optimizer state into
    `directory` (each rank its own, on its own node: they meet on storage), collectively with every
    rank. Returns the names of the files this rank wrote (rank 0's include DCP's `.metadata`)."""
    import torch.distributed.checkpoint as dcp

    weights, optimizer_state = _state_dicts(model, optimizer)
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": weights, "optimizer": optimizer_state}, storage_writer=dcp.FileSystemWriter(directory))
    return sorted(p.name for p in directory.iterdir())


def load(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a sharded checkpoint's model and optimizer state into this rank's shards, collectively:
    DCP reads each rank's part of every tensor, whatever the number of ranks that wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    weights, optimizer_state = _state_dicts(model, optimizer)
    state = {"model": weights, "optimizer": optimizer_state}
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    # Not strict: the frozen parameters are the model's own, as built. Every trained one is in `state`,
    # which DCP filled, or it raised for what the checkpoint lacked.
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's state, as this rank's shards (DTensors), keyed by parameter name:
    of the parameters that train (a LoRA run's adapters; the frozen base is the recipe's build_model's,
    rebuilt on load), as checkpoint/format.py's model_weights keeps them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes this rank holds of the model's parameters, their gradients (one for each parameter
    that trains, as the backward pass allocates them) and the optimizer state: under FSDP its shards,
    about 1/N of DDP's whole copy."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p) for p in model.parameters() if p.requires_grad]
    state = [_local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*params, *grads, *state])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor whole."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_tensor(value: Any) -> Any:
    """A DTensor's whole value (a gradient norm over every shard), else the value."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
