"""PEFT LoRA adapters from disk into the wrapper's stacked weights, one GPU slot each.

A PEFT LoRA adapter is a folder with two files:

* ``adapter_config.json``: ``r`` (the rank), ``lora_alpha``, ``use_rslora``,
  ``target_modules`` and more;
* ``adapter_model.safetensors``: for every adapted module of the base model, a pair
  ``...<module>.lora_A.weight`` ``[r, in]`` and ``...<module>.lora_B.weight`` ``[out, r]``.

A serving engine does not keep adapters one by one. For each of its LoRA layers it
keeps one stacked tensor per slice with a row block per GPU *slot*:
``lora_a [L, 1, max_rank, in]`` and ``lora_b [L, 1, out_s, max_rank]``, exactly what
:meth:`~punica_numba.PunicaWrapperNumba.add_lora_linear` takes. A layer may *pack*
several modules of the model as slices (vLLM fuses q/k/v into one QKV layer of 3
slices and gate/up into one of 2); :class:`PackedLinear` says which.

:class:`LoRASlots` holds those stacked tensors and ``lora_index_to_id`` (which
adapter id sits in which slot). Loading an adapter does what vLLM does when it
activates one (../shared/SPEC.md §2.2):

* the slot is zeroed, then each module's ``A`` and ``B`` are copied into the
  leading ``[:r]`` block of its slice, so a smaller rank is zero-padded (and a
  slice the adapter does not target stays zero);
* the scaling ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA) is
  multiplied into ``B`` once, so every layer calls the wrapper with ``scale=1.0``.

Everything is read, checked, padded and scaled into temporaries first; only then
are the slot's tensors overwritten. A rejected adapter leaves the slots as they
were. What this loader does not support (DoRA, ``modules_to_save``, per-module
ranks, LoRA biases, embedding or LM-head adapters) is rejected with a
``ValueError`` that names it.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._checks import check_int
from ._cuda import KERNEL_DTYPES

__all__ = ["PackedLinear", "PeftAdapter", "LoRASlots", "read_peft_adapter"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

#: PEFT's default ``lora_alpha`` when a config does not give one.
PEFT_DEFAULT_LORA_ALPHA = 8

#: ``base_model.model.<module>.lora_A.weight`` -> (module, "A")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")


@dataclass(frozen=True)
class PackedLinear:
    """One LoRA layer of an engine: the model's linear modules it packs, one slice each.

    Attributes:
        name: the layer's name, e.g. ``"model.layers.0.self_attn.qkv_proj"``.
        modules: the full module name of each slice, as PEFT names it (without
            PEFT's ``base_model.model.`` prefix), e.g. ``("model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")``.
        in_features: H, the input width every slice shares.
        output_slices: N_s, the output width of each slice (q wider than k/v under GQA).
    """

    name: str
    modules: tuple[str, ...]
    in_features: int
    output_slices: tuple[int, ...]

    def __post_init__(self):
        if len(self.modules) != len(self.output_slices) or not self.modules:
            raise ValueError(
                f"PackedLinear {self.name!r}: modules {self.modules} and output_slices "
                f"{self.output_slices} must be non-empty and of equal length"
            )


@dataclass
class PeftAdapter:
    """A PEFT LoRA adapter read from disk and checked on its own (not yet against a model).

    Attributes:
        path: the adapter's folder.
        rank: r, from the config; every module's tensors have this rank.
        lora_alpha: alpha, from the config (PEFT's default 8 when absent).
        use_rslora: whether the scaling is ``alpha / sqrt(r)`` rather than ``alpha / r``.
        target_modules: the config's ``target_modules`` (a list of names, a regex, or None).
        weights: module name -> ``(A [r, in], B [out, r])``, as saved (unscaled).
    """

    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str] | str | None
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def scaling(self) -> float:
        """What PEFT multiplies ``B @ A`` by: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _read_config(path: Path) -> dict:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; is it a PEFT adapter folder?")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


def _check_config(config: dict, file: Path) -> tuple[int, float, bool]:
    """The rank, alpha and rsLoRA flag, after rejecting what this loader does not support."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{file}: peft_type is {peft_type!r}; only LoRA adapters ('LORA') load")
    if config.get("use_dora"):
        raise ValueError(
            f"{file}: use_dora is true; DoRA adapters are not supported (their magnitude "
            "vector rescales the whole weight, which shrink/expand cannot express)"
        )
    if config.get("modules_to_save"):
        raise ValueError(
            f"{file}: modules_to_save={config['modules_to_save']!r} is not supported; only "
            "LoRA A/B pairs are served, not full copies of modules"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(
                f"{file}: {key}={config[key]!r} is not supported; every module must share "
                "the config's r and lora_alpha"
            )
    if config.get("lora_bias"):
        raise ValueError(f"{file}: lora_bias is true; LoRA biases are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{file}: bias={config['bias']!r} is not supported (it trains the base model's "
            "biases); only bias='none'"
        )
    if "r" not in config:
        raise ValueError(f"{file} has no 'r' (the LoRA rank)")
    rank = check_int(f"{file}: r", config["r"], minimum=1)
    alpha = config.get("lora_alpha", PEFT_DEFAULT_LORA_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise TypeError(f"{file}: use_rslora must be true or false, got {rslora!r}")
    return rank, float(alpha), rslora


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        folder = file.parent
        hint = " (adapter_model.bin, a pickle, is not read; re-save with safetensors)"
        raise FileNotFoundError(
            f"{folder} has no {WEIGHTS_NAME}"
            + (hint if (folder / "adapter_model.bin").exists() else "")
        )
    try:
        return load_file(file)
    except SafetensorError as err:
        raise ValueError(
            f"{file} is not a readable safetensors file (corrupt or truncated?): {err}"
        ) from err


def read_peft_adapter(path: str | os.PathLike) -> PeftAdapter:
    """Read and check a PEFT LoRA adapter folder (``adapter_config.json`` + safetensors).

    Raises:
        FileNotFoundError: a missing folder, config or weights file.
        ValueError: an unsupported feature (DoRA, ``modules_to_save``, ``rank_pattern``,
            LoRA biases), a config without ``r``, a corrupt or truncated safetensors
            file, a tensor that is not a LoRA A/B weight, an A without its B (or the
            reverse), a rank other than ``r``, or non-finite values.
        TypeError: a config value of the wrong type.
    """
    path = Path(path)
    config = _read_config(path)
    rank, alpha, rslora = _check_config(config, path / CONFIG_NAME)
    file = path / WEIGHTS_NAME
    tensors = _read_tensors(file)

    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            raise ValueError(f"{file}: {key!r} is a DoRA magnitude; DoRA is not supported")
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"{file}: unexpected tensor {key!r}; only '<module>.lora_A.weight' / "
                "'<module>.lora_B.weight' pairs of linear modules are supported (not "
                "modules_to_save, embedding adapters or LoRA biases)"
            )
        if not tensor.dtype.is_floating_point or tensor.ndim != 2:
            raise ValueError(
                f"{file}: {key} must be a 2-D floating-point matrix, got {tensor.dtype} of "
                f"shape {tuple(tensor.shape)}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{file}: {key} holds non-finite values (inf or nan)")
        halves.setdefault(match["module"], {})[match["half"]] = tensor

    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise ValueError(f"{file}: {module} has lora_{set(pair).pop()} but no lora_{missing}")
        a, b = pair["A"], pair["B"]  # [r, in], [out, r]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"{file}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"but the config's rank is r={rank} (A must be [r, in], B [out, r])"
            )
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"{file} holds no LoRA weights")
    return PeftAdapter(
        path=path,
        rank=rank,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=config.get("target_modules"),
        weights=weights,
    )


class LoRASlots:
    """The stacked LoRA weights of every LoRA layer of one model, one adapter per GPU slot.

    Args:
        layers: the model's LoRA layers (:class:`PackedLinear`), e.g. one QKV, one O,
            one gate/up and one down layer per decoder layer.
        max_loras: L, the number of GPU slots.
        max_lora_rank: r, the rank every slot is padded to (the kernels run at it).
        dtype: the weights' dtype (the model's).
        device: where they live (the kernels' device).

    Attributes:
        lora_a: layer name -> one ``[L, 1, r, in]`` tensor per slice.
        lora_b: layer name -> one ``[L, 1, N_s, r]`` tensor per slice, scaling folded in.
        lora_index_to_id: ``[L]``, the adapter id in each slot, or None: what
            ``update_metadata`` takes.
    """

    def __init__(
        self,
        layers: Sequence[PackedLinear],
        *,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.max_loras = check_int("max_loras", max_loras, minimum=1)
        self.max_lora_rank = check_int("max_lora_rank", max_lora_rank, minimum=1)
        if dtype not in KERNEL_DTYPES:
            raise TypeError(f"dtype must be one of {KERNEL_DTYPES}, got {dtype}")
        self.dtype, self.device = dtype, torch.device(device)
        self.layers = {layer.name: layer for layer in layers}
        if len(self.layers) != len(layers):
            raise ValueError("layers must have distinct names")
        # module name -> (layer name, slice index)
        self._slice_of: dict[str, tuple[str, int]] = {}
        for layer in layers:
            for s, module in enumerate(layer.modules):
                if module in self._slice_of:
                    raise ValueError(f"module {module!r} is in more than one layer")
                self._slice_of[module] = (layer.name, s)

        L, r = self.max_loras, self.max_lora_rank
        zeros = dict(dtype=dtype, device=self.device)
        self.lora_a = {
            layer.name: tuple(
                torch.zeros(L, 1, r, layer.in_features, **zeros) for _ in layer.output_slices
            )
            for layer in layers
        }
        self.lora_b = {
            layer.name: tuple(torch.zeros(L, 1, n, r, **zeros) for n in layer.output_slices)
            for layer in layers
        }
        self.lora_index_to_id: list[int | None] = [None] * L

    # -- which adapter is where ------------------------------------------------------

    def slot_of(self, adapter_id: int) -> int:
        """The slot that holds ``adapter_id`` (ValueError if it is not loaded)."""
        if adapter_id not in self:
            raise ValueError(
                f"adapter id {adapter_id} is not loaded; slots: {self.lora_index_to_id}"
            )
        return self.lora_index_to_id.index(adapter_id)

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id is not None and adapter_id in self.lora_index_to_id

    # -- load and evict ----------------------------------------------------------------

    def load(self, adapter_id: int, adapter: str | os.PathLike | PeftAdapter) -> int:
        """Put an adapter into the first free slot; return the slot.

        Semantics (for each layer l, slice s, with module m = l.modules[s]):
            lora_a[l][s][slot] = 0;  lora_a[l][s][slot, 0, :rank] = A_m
            lora_b[l][s][slot] = 0;  lora_b[l][s][slot, 0, :, :rank] = scaling * B_m
            (slices of modules the adapter does not adapt stay 0)
            lora_index_to_id[slot] = adapter_id

        Raises:
            TypeError / ValueError: a bad id (not an int >= 1, or already loaded), no
                free slot, anything :func:`read_peft_adapter` rejects, a rank above
                ``max_lora_rank``, a target module this model has no LoRA layer for,
                or a weight whose shape does not fit its module. Nothing is changed then.
        """
        adapter_id = check_int("adapter_id", adapter_id, minimum=1)
        if adapter_id in self.lora_index_to_id:
            raise ValueError(
                f"adapter id {adapter_id} is already in slot {self.slot_of(adapter_id)}; "
                "evict it first to reload it"
            )
        if None not in self.lora_index_to_id:
            raise ValueError(
                f"all {self.max_loras} slots are taken ({self.lora_index_to_id}); evict an "
                "adapter first"
            )
        if not isinstance(adapter, PeftAdapter):
            if not isinstance(adapter, (str, os.PathLike)):
                raise TypeError(
                    f"adapter must be a folder path or a PeftAdapter, got {type(adapter).__name__}"
                )
            adapter = read_peft_adapter(adapter)
        staged = self._stage(adapter)  # every check and conversion happens here

        slot = self.lora_index_to_id.index(None)
        for name in self.layers:
            for s in range(len(self.layers[name].modules)):
                a, b = (
                    self.lora_a[name][s][slot],
                    self.lora_b[name][s][slot],
                )  # [1, r, H], [1, N, r]
                if (name, s) in staged:
                    a.copy_(staged[name, s][0])
                    b.copy_(staged[name, s][1])
                else:
                    a.zero_()
                    b.zero_()
        self.lora_index_to_id[slot] = adapter_id
        return slot

    def evict(self, adapter_id: int) -> int:
        """Free the slot of ``adapter_id`` (its weights are zeroed); return the slot."""
        slot = self.slot_of(adapter_id)
        for name in self.layers:
            for a, b in zip(self.lora_a[name], self.lora_b[name]):
                a[slot].zero_()
                b[slot].zero_()
        self.lora_index_to_id[slot] = None
        return slot

    def _stage(self, adapter: PeftAdapter) -> dict[tuple[str, int], tuple[torch.Tensor, ...]]:
        """Check the adapter against this model; pad and scale it into new tensors.

        Returns (layer name, slice) -> ``(A [1, r_max, H], B [1, N_s, r_max])`` in this
        model's dtype and device. Nothing of ``self`` is touched.
        """
        where = adapter.path
        if adapter.rank > self.max_lora_rank:
            raise ValueError(
                f"{where}: rank r={adapter.rank} is above max_lora_rank={self.max_lora_rank}"
            )
        leaf_names = sorted({m.rsplit(".", 1)[-1] for m in self._slice_of})
        if isinstance(adapter.target_modules, (list, tuple)):
            for target in adapter.target_modules:
                if not any(m == target or m.endswith("." + target) for m in self._slice_of):
                    raise ValueError(
                        f"{where}: target module {target!r} is not a LoRA layer of this model "
                        f"(it has LoRA on {', '.join(leaf_names)})"
                    )
        unknown = sorted(set(adapter.weights) - set(self._slice_of))
        if unknown:
            raise ValueError(
                f"{where}: the adapter has weights for {len(unknown)} module(s) this model has "
                f"no LoRA layer for, e.g. {unknown[:3]} (it has LoRA on "
                f"{', '.join(leaf_names)} in {len(self.layers)} layers)"
            )

        r, rank, scaling = self.max_lora_rank, adapter.rank, adapter.scaling
        staged = {}
        for module, (a, b) in adapter.weights.items():
            name, s = self._slice_of[module]
            layer = self.layers[name]
            want_a, want_b = (rank, layer.in_features), (layer.output_slices[s], rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(
                    f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}; this model needs {want_a} and {want_b}"
                )
            padded_a = torch.zeros(1, r, layer.in_features, dtype=torch.float32)  # [1, r, H]
            padded_a[0, :rank] = a.float()
            padded_b = torch.zeros(1, layer.output_slices[s], r, dtype=torch.float32)  # [1, N, r]
            padded_b[0, :, :rank] = b.float() * scaling  # the scaling, folded in once
            staged[name, s] = (
                padded_a.to(dtype=self.dtype, device=self.device),
                padded_b.to(dtype=self.dtype, device=self.device),
            )
        return staged
