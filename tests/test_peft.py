"""PEFT adapters in the engine: loaded from disk, served in one batch, equal to PEFT's forward.

The yardstick is PEFT itself. Three adapters of mixed ranks (one rsLoRA, each with
other target modules, random non-zero A and B) are created with
``peft.get_peft_model`` and saved with ``save_pretrained``; the engine loads them
from disk and serves a mixed batch. Every request's logits must equal PEFT's own
forward on the same tokens, in its mixed-batch mode (``adapter_names=[...]``) and
one adapter at a time; requests without an adapter must equal the plain model.

The loader's errors are checked one by one, each time with the slots snapshotted
before and compared after: a rejected adapter must leave nothing half-loaded.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from punica_numba import demo
from punica_numba._cuda import device_of
from punica_numba.engine import LORA_MODULES, MultiLoRAEngine, Request, packed_layers, tiny_llama
from punica_numba.peft import LoRASlots, read_peft_adapter

peft = pytest.importorskip("peft")

# Awkward on purpose: head_dim 6, k/v slices half as wide as q (GQA), odd vocabulary.
SIZES = dict(
    vocab_size=97, hidden_size=24, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2
)
MAX_RANK = 8
#: A request agrees when max |engine - PEFT| <= REL x max |PEFT logits| (float32).
REL = demo.REL_FLOOR

#: name -> (engine id, LoraConfig arguments)
ADAPTERS = {
    "alpha": (11, dict(r=8, lora_alpha=16, target_modules=list(LORA_MODULES))),
    "beta": (
        22,
        dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj"]),
    ),
    "gamma": (33, dict(r=2, lora_alpha=6, target_modules=["v_proj", "gate_proj", "down_proj"])),
}
#: Loaded in this order, so that ids, names and slots all differ.
LOAD_ORDER = ("gamma", "alpha", "beta")


def save_peft_adapters(model, adapters: dict[str, dict], folder: Path, seed: int = 0):
    """Create the adapters on ``model`` with PEFT (random A and B), save each to folder/name."""
    configs = {
        name: peft.LoraConfig(init_lora_weights=False, **kwargs)
        for name, kwargs in adapters.items()
    }
    first, *rest = configs
    with warnings.catch_warnings():
        # transformers and PEFT warn about each other's deprecations; not our business here
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # PEFT saves the LM head's weights too when an adapter targets it (rejected later)
        warnings.filterwarnings("ignore", "Setting `save_embedding_layers`", UserWarning)
        torch.manual_seed(seed)
        peft_model = peft.get_peft_model(model, configs[first], adapter_name=first)
        for name in rest:
            peft_model.add_adapter(name, configs[name])
        peft_model.save_pretrained(folder)
    return peft_model.eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny Llama, its PEFT adapters on disk, and engines built on it before PEFT wrapped it."""
    folder = tmp_path_factory.mktemp("adapters")
    model = tiny_llama(**SIZES, seed=0)
    engine = MultiLoRAEngine(
        model, max_loras=4, max_lora_rank=MAX_RANK, max_num_batched_tokens=32, max_batches=8
    )
    spare = MultiLoRAEngine(
        model, max_loras=2, max_lora_rank=MAX_RANK, max_num_batched_tokens=32, max_batches=8
    )
    peft_model = save_peft_adapters(model, {n: kw for n, (_, kw) in ADAPTERS.items()}, folder)
    for name in LOAD_ORDER:
        engine.load_adapter(ADAPTERS[name][0], folder / name)
    return SimpleNamespace(
        folder=folder,
        engine=engine,
        spare=spare,
        peft_model=peft_model,
        plain=tiny_llama(**SIZES, seed=0),  # the same weights, never touched by PEFT
        layers=packed_layers(tiny_llama(**SIZES, seed=0)),
    )


# -- references -------------------------------------------------------------------------

DEVICE = device_of()  # where the engine and the plain model live


def teacher_forced(request: Request, tokens: list[int]) -> torch.Tensor:
    """The sequence the engine's logits were computed on: prompt + generated tokens but the last."""
    return torch.tensor([*request.prompt, *tokens[:-1]], device=DEVICE)


def generated_rows(logits: torch.Tensor, request: Request, steps: int) -> torch.Tensor:
    """``[S, V]`` logits of a sequence -> the ``steps`` rows that chose the generated tokens."""
    start = len(request.prompt) - 1
    return logits[start : start + steps].float()


@torch.no_grad()
def peft_mixed_batch(peft_model, requests, generations, names) -> list[torch.Tensor]:
    """PEFT's mixed-batch forward: one right-padded batch, ``adapter_names`` per row."""
    seqs = [teacher_forced(r, g.tokens) for r, g in zip(requests, generations)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64, device=DEVICE)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    logits = peft_model(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    return [
        generated_rows(logits[row], r, len(g.tokens))
        for row, (r, g) in enumerate(zip(requests, generations))
    ]


@torch.no_grad()
def peft_one_at_a_time(peft_model, request, generation, name) -> torch.Tensor:
    """PEFT's forward of one request alone, with only its adapter active (or none)."""
    ids = teacher_forced(request, generation.tokens)[None]
    if name == "__base__":
        with peft_model.disable_adapter():
            logits = peft_model(input_ids=ids).logits[0]
    else:
        peft_model.set_adapter(name)
        logits = peft_model(input_ids=ids).logits[0]
    return generated_rows(logits, request, len(generation.tokens))


def assert_agrees(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs()
    scale = want.abs().max().item()
    if err.max().item() > REL * scale:
        step, token = divmod(int(err.argmax()), err.shape[1])
        raise AssertionError(
            f"{what}: max |engine - reference| = {err.max().item():.3g} > {REL:g} x {scale:.3g}; "
            f"first worst at generated step {step}, vocabulary entry {token}: engine "
            f"{got[step, token].item()!r}, reference {want[step, token].item()!r}"
        )


# -- the engine against PEFT ---------------------------------------------------------------

NEW_TOKENS = 3


@pytest.fixture(scope="module")
def served(world):
    """One mixed batch through the engine: every adapter, no adapter twice, odd prompt lengths."""
    gen = torch.Generator().manual_seed(5)
    plan = [("alpha", 3), ("__base__", 2), ("beta", 4), ("gamma", 1), ("alpha", 2), ("__base__", 1)]
    requests = [
        Request(
            torch.randint(1, SIZES["vocab_size"], (n,), generator=gen).tolist(),
            ADAPTERS[name][0] if name in ADAPTERS else 0,
        )
        for name, n in plan
    ]
    names = [name for name, _ in plan]
    generations = world.engine.generate(requests, NEW_TOKENS, keep_logits=True)
    return SimpleNamespace(requests=requests, names=names, generations=generations)


def test_mixed_batch_equals_peft_mixed_batch(world, served):
    want = peft_mixed_batch(world.peft_model, served.requests, served.generations, served.names)
    for i, (g, w) in enumerate(zip(served.generations, want)):
        assert g.logits.shape == (NEW_TOKENS, SIZES["vocab_size"])
        assert g.tokens == g.logits.argmax(-1).tolist(), "greedy: each token is its row's argmax"
        assert_agrees(g.logits, w, f"request {i} ({served.names[i]}) vs PEFT's mixed batch")


def test_mixed_batch_equals_peft_one_adapter_at_a_time(world, served):
    for i, (r, g, name) in enumerate(zip(served.requests, served.generations, served.names)):
        want = peft_one_at_a_time(world.peft_model, r, g, name)
        assert_agrees(g.logits, want, f"request {i} ({name}) vs PEFT with only {name} active")


@torch.no_grad()
def test_requests_without_adapter_equal_the_plain_model(world, served):
    for i, (r, g, name) in enumerate(zip(served.requests, served.generations, served.names)):
        if name == "__base__":
            logits = world.plain(teacher_forced(r, g.tokens)[None]).logits[0]
            want = generated_rows(logits, r, NEW_TOKENS)
            assert_agrees(g.logits, want, f"request {i} (no adapter) vs the plain model")


@torch.no_grad()
def test_every_adapter_changes_the_logits(world, served):
    """Test the test: the adapters matter far beyond the tolerance, so a missing or
    wrong adapter could not pass the checks above."""
    for r, g, name in zip(served.requests, served.generations, served.names):
        if name != "__base__":
            base = generated_rows(
                world.plain(teacher_forced(r, g.tokens)[None]).logits[0], r, NEW_TOKENS
            )
            change = (g.logits - base).abs().max().item()
            assert change > 1000 * REL * base.abs().max().item(), (name, change)


@torch.no_grad()
def test_engine_without_adapters_generates_what_the_model_generates(world):
    """Batching, padding-free rows, the KV cache and RoPE positions: no LoRA involved."""
    gen = torch.Generator().manual_seed(8)
    requests = [
        Request(torch.randint(1, SIZES["vocab_size"], (n,), generator=gen).tolist())
        for n in (5, 1, 3)
    ]
    got = world.engine.generate(requests, 4, keep_logits=True)
    for r, g in zip(requests, got):
        prompt = torch.tensor([r.prompt], device=DEVICE)
        want = world.plain.generate(prompt, max_new_tokens=4, do_sample=False)[
            0, len(r.prompt) :
        ].tolist()
        assert g.tokens == want
        logits = world.plain(teacher_forced(r, g.tokens)[None]).logits[0]
        assert_agrees(g.logits, generated_rows(logits, r, 4), "no adapter vs the plain model")


def test_engine_rejects_what_it_cannot_serve(world):
    engine = world.engine
    with pytest.raises(ValueError, match="more than max_num_batched_tokens=32"):
        engine.generate([Request([1] * 20), Request([2] * 13)], 1)
    with pytest.raises(ValueError, match="adapter id 99, which is not loaded"):
        engine.generate([Request([1], 99)], 1)
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        engine.generate([Request([1])], 256)
    with pytest.raises(ValueError, match="at least one prompt token"):
        Request([])


def test_an_evicted_slot_serves_the_adapter_loaded_into_it(world):
    spare, folder = world.spare, world.folder
    assert spare.load_adapter(1, folder / "alpha") == 0
    assert spare.load_adapter(2, folder / "beta") == 1
    assert spare.evict_adapter(1) == 0
    assert spare.lora_index_to_id == [None, 2]
    assert spare.load_adapter(3, folder / "gamma") == 0  # the freed slot is reused
    requests = [Request([5, 6, 7], 3), Request([8, 9], 2)]
    with pytest.raises(ValueError, match="adapter id 1, which is not loaded"):
        spare.generate([Request([5], 1)], 1)
    generations = spare.generate(requests, 2, keep_logits=True)
    want = peft_mixed_batch(world.peft_model, requests, generations, ["gamma", "beta"])
    for g, w, name in zip(generations, want, ["gamma", "beta"]):
        assert_agrees(g.logits, w, f"{name} in a reused slot")


@torch.no_grad()
def test_bfloat16_engine_is_as_close_to_exact_as_peft_in_bfloat16(tmp_path):
    """The GPU's dtype: the engine in bf16 errs no more than PEFT's own bf16 forward."""
    model = tiny_llama(**SIZES, seed=1, dtype=torch.bfloat16)
    engine = MultiLoRAEngine(model, max_loras=2, max_lora_rank=MAX_RANK, max_num_batched_tokens=16)
    chosen = {n: ADAPTERS[n][1] for n in ("alpha", "beta")}
    peft_model = save_peft_adapters(model, chosen, tmp_path)
    engine.load_adapter(1, tmp_path / "alpha")
    engine.load_adapter(2, tmp_path / "beta")
    requests = [Request([3, 1, 4], 1), Request([1, 5], 0), Request([9, 2, 6, 5], 2)]
    names = ["alpha", "__base__", "beta"]
    generations = engine.generate(requests, 2, keep_logits=True)
    same = demo.peft_logits(peft_model, requests, generations, names)
    exact = demo.peft_logits(peft_model.to(torch.float32), requests, generations, names)
    for g, p, e, name in zip(generations, same, exact, names):
        check = demo.agreement(g.logits, p, e)
        assert check.peft_err > 0, "bf16 must round somewhere"
        assert check.agrees, (name, check)


# -- the loader: padding, scaling, slots ---------------------------------------------------


def _peft_layer(peft_model, module: str):
    return peft_model.base_model.model.get_submodule(module)


def test_stacked_weights_are_zero_padded_and_scaled_like_peft(world):
    slots, peft_model = world.engine.slots, world.peft_model
    for name, (lora_id, kwargs) in ADAPTERS.items():
        slot, rank = slots.slot_of(lora_id), kwargs["r"]
        for layer in slots.layers.values():
            for s, module in enumerate(layer.modules):
                a = slots.lora_a[layer.name][s][slot, 0]  # [R, H]
                b = slots.lora_b[layer.name][s][slot, 0]  # [N, R]
                assert a.shape == (MAX_RANK, layer.in_features)
                assert b.shape == (layer.output_slices[s], MAX_RANK)
                if module.rsplit(".", 1)[1] not in kwargs["target_modules"]:
                    assert not a.any() and not b.any(), f"{name} does not adapt {module}"
                    continue
                lora = _peft_layer(peft_model, module)
                torch.testing.assert_close(a[:rank], lora.lora_A[name].weight, rtol=0, atol=0)
                torch.testing.assert_close(
                    b[:, :rank], lora.lora_B[name].weight * lora.scaling[name]
                )
                assert not a[rank:].any() and not b[:, rank:].any(), "rank zero-padding"


def test_rslora_scaling_is_alpha_over_sqrt_rank(world):
    beta = read_peft_adapter(world.folder / "beta")
    assert beta.use_rslora and beta.rank == 4 and beta.lora_alpha == 8
    assert beta.scaling == 8 / math.sqrt(4) == 4.0  # not alpha / r = 2
    peft_scaling = _peft_layer(world.peft_model, "model.layers.0.self_attn.v_proj").scaling
    assert beta.scaling == peft_scaling["beta"]
    assert read_peft_adapter(world.folder / "gamma").scaling == 6 / 2 == peft_scaling["gamma"]


def _fresh_slots(world, max_loras: int = 3) -> LoRASlots:
    return LoRASlots(
        world.layers,
        max_loras=max_loras,
        max_lora_rank=MAX_RANK,
        dtype=torch.float32,
        device=world.engine.device,
    )


def _snapshot(slots: LoRASlots):
    tensors = [t.clone() for n in slots.layers for t in (*slots.lora_a[n], *slots.lora_b[n])]
    return tensors, list(slots.lora_index_to_id)


def _assert_unchanged(slots: LoRASlots, before) -> None:
    tensors, ids = _snapshot(slots)
    assert ids == before[1], "lora_index_to_id changed"
    for i, (now, then) in enumerate(zip(tensors, before[0])):
        assert torch.equal(now, then), f"stacked tensor {i} changed: something was half-loaded"


def test_evict_zeroes_the_slot_and_the_next_load_reuses_it(world):
    slots = _fresh_slots(world, max_loras=2)
    assert slots.load(5, world.folder / "alpha") == 0
    assert slots.load(6, world.folder / "beta") == 1
    with pytest.raises(ValueError, match="all 2 slots are taken"):
        slots.load(7, world.folder / "gamma")
    beta_before = [
        (a[1].clone(), b[1].clone())
        for n in slots.layers
        for a, b in zip(slots.lora_a[n], slots.lora_b[n])
    ]
    assert slots.evict(5) == 0
    assert slots.lora_index_to_id == [None, 6] and 5 not in slots
    for n in slots.layers:
        assert not any(a[0].any() or b[0].any() for a, b in zip(slots.lora_a[n], slots.lora_b[n]))
    assert slots.load(7, world.folder / "gamma") == 0
    assert slots.lora_index_to_id == [7, 6]
    beta_after = [
        (a[1], b[1]) for n in slots.layers for a, b in zip(slots.lora_a[n], slots.lora_b[n])
    ]
    for (a0, b0), (a1, b1) in zip(beta_before, beta_after):
        assert torch.equal(a0, a1) and torch.equal(b0, b1), "the other slot must not change"
    # gamma does not adapt q: a slot that held alpha (which did) must be clean again
    q_slot = slots.lora_a["model.layers.0.self_attn.qkv_proj"][0][0]
    assert not q_slot.any()
    with pytest.raises(ValueError, match="adapter id 5 is not loaded"):
        slots.evict(5)
    slots.evict(7)
    with pytest.raises(ValueError, match="adapter id None is not loaded"):
        slots.evict(None)  # a free slot holds None, but None is no adapter


@pytest.mark.parametrize(
    "adapter_id, error, match",
    [
        (0, ValueError, "adapter_id must be >= 1"),
        (-3, ValueError, "adapter_id must be >= 1"),
        (True, TypeError, "adapter_id must be an int"),
        ("4", TypeError, "adapter_id must be an int"),
        (5, ValueError, "already in slot 0"),
    ],
)
def test_bad_adapter_ids_are_rejected(world, adapter_id, error, match):
    slots = _fresh_slots(world)
    slots.load(5, world.folder / "alpha")
    before = _snapshot(slots)
    with pytest.raises(error, match=match):
        slots.load(adapter_id, world.folder / "gamma")
    _assert_unchanged(slots, before)


# -- the loader: what it rejects, leaving nothing half-loaded --------------------------------


def _copy(world, tmp_path, name: str = "gamma") -> Path:
    folder = tmp_path / f"broken_{name}"
    shutil.copytree(world.folder / name, folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    file = folder / "adapter_config.json"
    config = json.loads(file.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del config[key]
        else:
            config[key] = value
    file.write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit) -> None:
    file = folder / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


_DELETE = object()
_GAMMA_V1 = "base_model.model.model.layers.1.self_attn.v_proj"  # the last module, sorted


def _no_r(folder):
    _edit_config(folder, r=_DELETE)


def _r_as_text(folder):
    _edit_config(folder, r="2")


def _dora_config(folder):
    _edit_config(folder, use_dora=True)


def _dora_magnitude(folder):
    _edit_tensors(
        folder,
        lambda t: t.update({f"{_GAMMA_V1}.lora_magnitude_vector": torch.ones(12)}),
    )


def _modules_to_save(folder):
    _edit_config(folder, modules_to_save=["lm_head"])


def _rank_pattern(folder):
    _edit_config(folder, rank_pattern={"v_proj": 1})


def _rank_above_max(folder):
    def widen(t):
        for key in list(t):
            if key.endswith("lora_A.weight"):
                t[key] = torch.randn(MAX_RANK + 1, t[key].shape[1])
            else:
                t[key] = torch.randn(t[key].shape[0], MAX_RANK + 1)

    _edit_tensors(folder, widen)
    _edit_config(folder, r=MAX_RANK + 1)


def _config_rank_differs(folder):
    _edit_config(folder, r=4)  # the tensors have rank 2


def _target_the_model_lacks(folder):
    _edit_config(folder, target_modules=["v_proj", "c_attn"])


def _weights_of_a_missing_layer(folder):
    def add(t):
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.randn(2, 24)
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.randn(24, 2)

    _edit_tensors(folder, add)


def _wrong_shape_in_the_last_module(folder):
    _edit_tensors(folder, lambda t: t.update({f"{_GAMMA_V1}.lora_B.weight": torch.randn(13, 2)}))


def _lora_b_missing(folder):
    _edit_tensors(folder, lambda t: t.pop(f"{_GAMMA_V1}.lora_B.weight"))


def _not_finite(folder):
    def poison(t):
        t[f"{_GAMMA_V1}.lora_A.weight"][0, 0] = float("nan")

    _edit_tensors(folder, poison)


def _stray_tensor(folder):
    _edit_tensors(folder, lambda t: t.update({"base_model.model.lm_head.weight": torch.ones(2)}))


def _truncated(folder):
    file = folder / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:-9])


def _garbage(folder):
    (folder / "adapter_model.safetensors").write_bytes(b"this is not a safetensors file")


def _empty(folder):
    (folder / "adapter_model.safetensors").write_bytes(b"")


def _bad_json(folder):
    (folder / "adapter_config.json").write_text('{"r": 2,')


def _no_weights_file(folder):
    (folder / "adapter_model.safetensors").unlink()


def _no_config_file(folder):
    (folder / "adapter_config.json").unlink()


@pytest.mark.parametrize(
    "break_it, error, match",
    [
        (_no_r, ValueError, "has no 'r'"),
        (_r_as_text, TypeError, "r must be an int"),
        (_dora_config, ValueError, "DoRA"),
        (_dora_magnitude, ValueError, "DoRA"),
        (_modules_to_save, ValueError, "modules_to_save"),
        (_rank_pattern, ValueError, "rank_pattern"),
        (_rank_above_max, ValueError, "above max_lora_rank=8"),
        (_config_rank_differs, ValueError, "config's rank is r=4"),
        (_target_the_model_lacks, ValueError, "target module 'c_attn' is not a LoRA layer"),
        (_weights_of_a_missing_layer, ValueError, "no LoRA layer for.*layers.7"),
        (_wrong_shape_in_the_last_module, ValueError, "v_proj.*this model needs"),
        (_lora_b_missing, ValueError, "has lora_A but no lora_B"),
        (_not_finite, ValueError, "non-finite"),
        (_stray_tensor, ValueError, "unexpected tensor.*lm_head"),
        (_truncated, ValueError, "corrupt or truncated"),
        (_garbage, ValueError, "corrupt or truncated"),
        (_empty, ValueError, "corrupt or truncated"),
        (_bad_json, ValueError, "not valid JSON"),
        (_no_weights_file, FileNotFoundError, "adapter_model.safetensors"),
        (_no_config_file, FileNotFoundError, "adapter_config.json"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_a_broken_adapter_is_rejected_and_nothing_is_half_loaded(
    world, tmp_path, break_it, error, match
):
    folder = _copy(world, tmp_path)
    break_it(folder)
    slots = _fresh_slots(world)
    slots.load(5, world.folder / "alpha")  # slot 0 busy, slot 1 is where gamma would go
    before = _snapshot(slots)
    with pytest.raises(error, match=match):
        slots.load(6, folder)
    _assert_unchanged(slots, before)


@pytest.mark.parametrize(
    "model_sizes, config, match",
    [
        ({}, dict(r=2, target_modules=["q_proj"], use_dora=True), "DoRA"),
        ({}, dict(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
        ({}, dict(r=16, target_modules=["q_proj"]), "r=16 is above max_lora_rank=8"),
        (
            {},
            dict(r=2, target_modules=["q_proj", "lm_head"]),
            "unexpected tensor 'base_model.model.lm_head",
        ),
        ({"num_layers": 3}, dict(r=2, target_modules=["q_proj"]), "no LoRA layer for.*layers.2"),
        ({"hidden_size": 32}, dict(r=2, target_modules=["o_proj"]), "this model needs"),
    ],
    ids=["dora", "modules_to_save", "rank16", "lm_head", "deeper_model", "wider_model"],
)
def test_adapters_peft_saved_that_the_loader_does_not_support(
    world, tmp_path, model_sizes, config, match
):
    """The same errors, for files PEFT itself wrote."""
    model = tiny_llama(**{**SIZES, **model_sizes}, seed=2)
    save_peft_adapters(model, {"unsupported": config}, tmp_path)
    slots = _fresh_slots(world)
    slots.load(5, world.folder / "alpha")
    before = _snapshot(slots)
    with pytest.raises(ValueError, match=match):
        slots.load(6, tmp_path / "unsupported")
    _assert_unchanged(slots, before)


def test_adapter_must_be_a_path_or_a_peft_adapter(world):
    slots = _fresh_slots(world)
    with pytest.raises(TypeError, match="folder path or a PeftAdapter"):
        slots.load(1, 42)
    assert slots.lora_index_to_id == [None, None, None]
