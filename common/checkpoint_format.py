"""Parameters under the names and shapes of the model's checkpoint. transformers 5 fuses some checkpoint tensors into
one parameter when it loads them (a mixture-of-experts layer's per-expert `experts.{e}.gate_proj/up_proj/down_proj`
become one 3D `experts.gate_up_proj` and `experts.down_proj`) and splits them back when it saves. vLLM's
`reload_weights` reads the checkpoint's format, so the weights a sync sends are split the same way; every other
parameter keeps its own name."""
from __future__ import annotations

from typing import Iterator, Optional

import torch


def fuses_tensors(model) -> bool:
    """Whether `model` (a PEFT wrapper's base included) was built with tensors fused at load."""
    from transformers.core_model_loading import WeightConverter
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return any(isinstance(c, WeightConverter) for c in getattr(base, "_weight_conversions", None) or [])


def as_checkpoint(model, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensor` (parameter `name` of `model`, whole) as the checkpoint holds it: a fused one as its parts under their
    checkpoint names, in a fixed order (transformers' own reverse conversion); any other as it is. A meta tensor
    gives the parts' shapes alone."""
    from transformers.core_model_loading import revert_weight_conversion
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parts = revert_weight_conversion(base, {name: tensor})
    if len(parts) == 1 and next(iter(parts.values())).shape == tensor.shape:
        yield name, tensor  # not fused (a rename alone is left as it was: vLLM has always loaded these names)
        return
    for part, value in parts.items():
        yield part, value.contiguous()


def checkpoint_slots(model) -> dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Where each tensor a sync sends (`as_checkpoint` names) goes in `model`: (parameter, None) for a parameter sent
    as it is, (fused parameter, the flat positions of the part's elements in it) for a part (`write`)."""
    slots: dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
    fused = fuses_tensors(model)
    for name, p in model.named_parameters(remove_duplicate=False):
        slots[name] = (p, None)
        if fused and [n for n, _ in as_checkpoint(model, name, torch.empty(p.shape, device="meta"))] != [name]:
            positions = torch.arange(p.numel()).view(p.shape)  # the reverse conversion moves them as it moves values
            for part, where in as_checkpoint(model, name, positions):
                slots[part] = (p, where.reshape(-1))
    return slots


def write(slot: tuple[torch.Tensor, Optional[torch.Tensor]], value: torch.Tensor) -> None:
    """Copy `value` into its slot (no autograd: the caller holds torch.no_grad)."""
    param, where = slot
    if where is None:
        param.copy_(value)
    else:
        param.view(-1)[where] = value.reshape(-1).to(param.dtype)
