"""float8 training: the model's eligible ``nn.Linear`` layers converted by torchao, and which and why.

The first transform of the model (before activation checkpointing, FSDP2 sharding and
``torch.compile``, as torchtitan orders them: checkpointing and sharding wrap the layers float8
replaced, and compile must see the float8 casts to fuse them). This is the one module that
imports torchao (an optional extra, ``pip install -e ".[fp8]"``, whose API moves).

The rule (:func:`float8_plan`), each skipped layer with its reason:

- the first and the last ``nn.Linear`` in module order (the input projection and the output head,
  where float8's rounding costs the most accuracy);
- layers in ``fp32_modules`` (they run outside autocast);
- ``nn.MultiheadAttention``'s ``out_proj`` (called through its weight, never its forward: converting
  it would change nothing);
- layers whose ``in_features`` or ``out_features`` is not a multiple of 16 (float8 matmuls need it);
- on CUDA, layers too small to gain (torchao's thresholds, measured on H100s).

A ``module_filter(module, name) -> bool`` given by the user replaces the first/last and size rules;
the other rules still hold (they are what float8 cannot do, not what it should not).
"""
import dataclasses
import logging
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

__all__ = ["RECIPES", "DEFAULT_RECIPE", "Float8Report", "float8_plan", "check_float8_device", "convert_to_float8",
           "float8_change", "precompute_float8_scales"]

logger = logging.getLogger("ignite_amp")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# tensorwise: torchao's fastest recipe on H100 and the only one whose weights FSDP2 can all-gather in float8.
DEFAULT_RECIPE = "tensorwise"
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


class Layer(NamedTuple):
    name: str
    reason: Optional[str]  # None: converted


@dataclasses.dataclass(frozen=True)
class Float8Report:
    """What :func:`convert_to_float8` did: the recipe, whether emulated, converted and skipped layers."""

    recipe: str
    emulated: bool
    converted: Tuple[str, ...]
    skipped: Tuple[Tuple[str, str], ...]  # (name, reason)
    fsdp_all_gather: bool = False  # FSDP2 all-gathers the converted weights in float8 (tensorwise)

    def line(self) -> str:
        """``float8 tensorwise (emulated): converted 2 of 4 Linear layers (a, b); skipped: c (first Linear), ...``"""
        how = f"float8 {self.recipe}{' (emulated on CPU)' if self.emulated else ''}" + \
              (", FSDP2 all-gathers them in float8" if self.fsdp_all_gather else "")
        total = len(self.converted) + len(self.skipped)
        converted = f" ({', '.join(self.converted)})" if self.converted else ""
        skipped = "; skipped: " + ", ".join(f"{n} ({r})" for n, r in self.skipped) if self.skipped else ""
        return f"{how}: converted {len(self.converted)} of {total} Linear layers{converted}{skipped}"

    def facts(self) -> dict:
        """Flat run facts (TensorBoard text and HParams)."""
        return {"float8_recipe": self.recipe, "float8_emulated": self.emulated,
                "float8_converted": ", ".join(self.converted) or "none",
                "float8_skipped": ", ".join(f"{n} ({r})" for n, r in self.skipped) or "none"}


def _too_small(recipe: str, module: nn.Linear) -> Optional[str]:
    """torchao's H100 thresholds (``torchao.float8.float8_linear_utils._auto_filter_for_*``), with the reason."""
    n, k = module.out_features, module.in_features
    if recipe == "tensorwise":
        if k <= 4096 and n <= 1024:
            return f"too small to gain on CUDA ({k}x{n}: tensorwise needs in_features > 4096 or out_features > 1024)"
        return None
    if n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048):
        return (f"too small to gain on CUDA ({k}x{n}: rowwise needs out_features > 2048 and in_features > 1024, "
                f"and not both <= 4096x2048)")
    return None


def _within(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def float8_plan(model: nn.Module, recipe: str = DEFAULT_RECIPE, device_type: str = "cpu",
                fp32_modules: Sequence[str] = (), module_filter: Optional[Callable[[nn.Module, str], bool]] = None,
                ) -> List[Layer]:
    """Every ``nn.Linear`` of ``model`` in module order with None (to convert) or the reason it is skipped.

    Pure: reads the model, imports nothing of torchao.
    """
    if recipe not in RECIPES:
        raise ValueError(f"float8_recipe should be one of {', '.join(RECIPES)}, got {recipe!r}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"float8_filter should be a function (module, name) -> bool, "
                        f"got {type(module_filter).__name__}")
    attention = [name for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    called = [name for name, _ in linears if not _within(name, attention)]
    first, last = (called[0], called[-1]) if called else (None, None)
    plan = []
    for name, module in linears:
        reason: Optional[str]  # None: converted
        if _within(name, fp32_modules):
            reason = "in fp32_modules"
        elif _within(name, attention):
            reason = "MultiheadAttention calls it through its weight, not its forward"
        elif module_filter is None and name == first:
            reason = "first Linear"
        elif module_filter is None and name == last:
            reason = "last Linear"
        elif module.in_features % 16 or module.out_features % 16:
            reason = f"{module.in_features}x{module.out_features}: float8 needs multiples of 16"
        elif module_filter is not None:
            reason = None if module_filter(module, name) else "float8_filter said no"
        else:
            reason = _too_small(recipe, module) if device_type == "cuda" else None
        plan.append(Layer(name, reason))
    return plan


def float8_change(saved: Optional[str], report: Optional[Float8Report]) -> Optional[str]:
    """The line a resume says when a checkpoint's float8 recipe (None: none) differs from this run's; else None.

    float8 keeps no state of its own (dynamic scales are recomputed each step): the float32 weights load
    the same either way, so the change is explained, not refused.
    """
    now = report.recipe if report is not None else None
    if saved == now:
        return None

    def precision(recipe: Optional[str]) -> str:
        return f"with float8 {recipe} Linear layers" if recipe else "without float8"

    return (f"resuming a checkpoint trained {precision(saved)} in a run {precision(now)}: the float32 weights load "
            f"as they are (float8 scales are recomputed each step); expect the loss to move a little in the "
            f"first steps")


def check_float8_device(device: Union[str, torch.device]) -> bool:
    """True when float8 runs emulated here (not on a GPU); a GPU below compute capability 8.9 is a ValueError."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(f"dtype float8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use "
                         f"dtype bfloat16 (or float16 before Ampere)")
    return False


class _DropThirdParty(logging.Filter):
    """Drops torch's log records about torchao's own registrations (``<enum 'KernelPreference'> ...
    register_constant() on Enum subclasses is deprecated``): torchao's to fix, nothing a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "register_constant" not in record.getMessage()


_QUIET = _DropThirdParty()


def _torchao():
    pytree = logging.getLogger("torch.utils._pytree")  # where torch logs torchao's registrations on import
    pytree.addFilter(_QUIET)
    try:
        from torchao import float8
    except ImportError:
        raise ValueError('dtype float8 needs torchao, which is not installed: pip install -e ".[fp8]" '
                         '(or pip install "torchao>=0.17"); other dtypes run without it') from None
    finally:
        pytree.removeFilter(_QUIET)
    return float8


def _to_autocast_dtype(module: nn.Module, args: tuple) -> Optional[tuple]:
    x = args[0]
    if torch.is_tensor(x) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return (x.to(torch.get_autocast_dtype(x.device.type)),) + args[1:]
    return None


def convert_to_float8(model: nn.Module, recipe: str = DEFAULT_RECIPE, device: Union[str, torch.device] = "cpu",
                      fp32_modules: Sequence[str] = (),
                      module_filter: Optional[Callable[[nn.Module, str], bool]] = None,
                      fsdp_all_gather: bool = False) -> Float8Report:
    """Convert ``model``'s eligible ``nn.Linear`` layers in place to torchao's float8 training layers.

    Run under bfloat16 autocast (``dtype="float8"`` on the factories does both). Off a GPU the float8
    matmuls are emulated (same numerics, no speed-up): that is how the tests run it. A model converted
    before returns its first report (the trainer and the evaluator share a model).

    ``fsdp_all_gather`` (tensorwise only; for a model FSDP2 shards next): the weights are all-gathered
    in float8 (half bfloat16's traffic); their scales are then computed once per optimizer step by
    :func:`precompute_float8_scales`, which ``create_amp_trainer`` attaches to ``OPTIMIZER_STEPPED``.

    Example:
        >>> import torch
        >>> from ignite_amp.transforms.float8 import convert_to_float8
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
        ...                             torch.nn.ReLU(), torch.nn.Linear(32, 2))
        >>> convert_to_float8(model).line()  # doctest: +NORMALIZE_WHITESPACE
        'float8 tensorwise (emulated on CPU): converted 1 of 3 Linear layers (2); skipped: 0 (first Linear),
        4 (last Linear)'
    """
    done = getattr(model, "_ignite_amp_float8", None)
    if done is not None:
        if done.recipe != recipe:
            raise ValueError(f"float8_recipe: the model was already converted with {done.recipe}, {recipe} was asked "
                             f"for; a conversion cannot be undone: build the model again, or ask for {done.recipe}")
        return done
    emulated = check_float8_device(device)
    plan = float8_plan(model, recipe, torch.device(device).type, fp32_modules, module_filter)
    float8 = _torchao()
    convert = {layer.name for layer in plan if layer.reason is None}
    if convert:
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        if emulated:
            config = dataclasses.replace(config, emulate=True)
        fsdp_all_gather = fsdp_all_gather and recipe == "tensorwise"  # torchao: the other recipes gather bf16
        if fsdp_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in convert)
        if emulated:  # torchao casts a layer's input to the autocast dtype on CUDA only: do it here too
            for name in convert:
                model.get_submodule(name).register_forward_pre_hook(_to_autocast_dtype)
    report = Float8Report(recipe, emulated, tuple(layer.name for layer in plan if layer.reason is None),
                          tuple((layer.name, layer.reason) for layer in plan if layer.reason is not None),
                          bool(convert) and fsdp_all_gather)
    if not convert:
        logger.warning(f"float8 changes nothing here: no Linear layer qualifies ({report.line()}); "
                       f"bfloat16 autocast runs the model as it is")
    elif emulated:
        logger.warning(f"float8 on {torch.device(device).type}: emulated by torchao (float8 numerics, no speed-up; "
                       f"for testing), {len(convert)} Linear layer{'s' if len(convert) != 1 else ''} converted")
    # a plain attribute (not a submodule, not in the state dict); torch's stubs type Module attributes as tensors
    # or modules only
    model._ignite_amp_float8 = report  # type: ignore[assignment]
    return report


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step of a sharded model converted with ``fsdp_all_gather``: every float8
    weight's scale in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), instead
    of one per layer inside the next forward's all-gathers."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(model)
