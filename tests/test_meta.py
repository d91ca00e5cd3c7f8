"""Property tests of ``LoRAKernelMeta``: sort and segment, checked against plain Python.

The model below knows nothing of torch: it sorts token positions with ``sorted()``
(which is stable), counts slots with loops, and writes out the fixed-size buffers
vLLM's metadata would hold (SPEC §3). Every test draws its dims first (tokens T,
slots L, spare capacity), then an assignment mode (``slot_lists``), then values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba.kernels.segments import tile_table, tile_tokens
from punica_numba.launch import launch_configs
from punica_numba.meta import LoRAKernelMeta, Segment, host_facts_of

from .strategies import DEVICE, META_LIMITS, MODES, assign_slots, slot_lists

#: The device buffers of a meta, in the order ``meta_args`` returns them.
DEVICE_FIELDS = (
    "token_lora_mapping",
    "token_indices_sorted_by_lora_ids",
    "num_tokens_per_lora",
    "lora_token_start_loc",
    "active_lora_ids",
)
HOST_FIELDS = ("no_lora_flag_cpu", "num_tokens", "max_slot_in_use")


# -- the plain-Python model ------------------------------------------------------------


def plain_segments(slots: list[int]):
    """Stable order of the tokens by slot, the distinct slots, their counts and starts."""
    order = sorted(range(len(slots)), key=lambda t: slots[t])  # sorted() is stable
    ids = sorted(set(slots))  # ascending: -1 first when present
    counts = []
    for slot in ids:
        n = 0
        for s in slots:
            if s == slot:
                n += 1
        counts.append(n)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return order, ids, counts, starts


@dataclass
class Expected:
    """Everything a meta should hold after ``prepare_tensors(slots)``, as plain lists."""

    token_lora_mapping: list[int]  # [M_max]
    token_indices_sorted_by_lora_ids: list[int]  # [M_max]
    num_tokens_per_lora: list[int]  # [L+1]
    lora_token_start_loc: list[int]  # [L+2]
    active_lora_ids: list[int]  # [L+1]
    no_lora_flag_cpu: list[bool]  # [1]
    num_tokens: int
    max_slot_in_use: int


def plain_meta(slots: list[int], num_loras: int, max_num_tokens: int) -> Expected:
    """The buffers after one prepare: the reset state when no token has a LoRA."""
    T = len(slots)
    mapping = list(slots) + [-1] * (max_num_tokens - T)
    identity = list(range(max_num_tokens))
    if all(s == -1 for s in slots):  # vLLM returns early: every buffer keeps its reset value
        return Expected(
            mapping, identity, [0] * (num_loras + 1), [0] * (num_loras + 2),
            [-1] * (num_loras + 1), [True], T, -1,
        )  # fmt: skip
    order, ids, counts, starts = plain_segments(slots)
    unused = num_loras + 1 - len(ids)
    return Expected(
        token_lora_mapping=mapping,
        token_indices_sorted_by_lora_ids=order + identity[T:],
        num_tokens_per_lora=counts + [0] * unused,
        lora_token_start_loc=starts + [0] * unused,
        active_lora_ids=ids + [-1] * unused,
        no_lora_flag_cpu=[False],
        num_tokens=T,
        max_slot_in_use=max(slots),
    )


# -- reading a meta back, and readable failures -----------------------------------------


def snapshot(meta: LoRAKernelMeta) -> dict:
    """Every field of a meta, read back to plain Python values."""
    out = {name: getattr(meta, name).tolist() for name in DEVICE_FIELDS}
    out["no_lora_flag_cpu"] = meta.no_lora_flag_cpu.tolist()
    out["num_tokens"] = meta.num_tokens
    out["max_slot_in_use"] = meta.max_slot_in_use
    return out


def assert_same(got: dict, want: dict, context: str = "") -> None:
    """Field by field; a failure names the field, its length, the first differing index."""
    for name in DEVICE_FIELDS + HOST_FIELDS:
        g, w = got[name], want[name]
        if isinstance(w, list):
            assert len(g) == len(w), f"{context}{name}: length {len(g)}, expected {len(w)}"
            for i, (a, b) in enumerate(zip(g, w)):
                assert a == b, (
                    f"{context}{name} [{len(g)}]: first difference at index {i}: "
                    f"got {a}, expected {b}"
                )
        else:
            assert g == w, f"{context}{name}: got {g}, expected {w}"


def as_dict(expected: Expected) -> dict:
    return {name: getattr(expected, name) for name in DEVICE_FIELDS + HOST_FIELDS}


def shares_memory(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """A view of ``buffer`` from its start (an empty slice has no data pointer of its own)."""
    same_storage = view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return same_storage and view.storage_offset() == buffer.storage_offset()


def mapping_tensor(slots: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(slots, dtype=dtype, device=DEVICE).reshape(len(slots))  # [T]


# -- strategies: dims first, then the mode, then values ----------------------------------


@st.composite
def meta_cases(draw, max_tokens: int = META_LIMITS.tokens):
    """``(slots, L, M_max)``: T and L, then spare capacity, then the slots."""
    T = draw(st.integers(0, max_tokens), label="T")
    L = draw(st.integers(1, META_LIMITS.loras), label="L")
    spare = draw(st.sampled_from([0, 1, 7, 33]), label="spare capacity")
    slots = draw(slot_lists(T, L), label="slots")
    return slots, L, T + spare


def prepared(slots: list[int], L: int, M_max: int, dtype=torch.int64) -> LoRAKernelMeta:
    meta = LoRAKernelMeta.make(L, M_max, DEVICE)
    meta.prepare_tensors(mapping_tensor(slots, dtype))
    return meta


# -- properties ---------------------------------------------------------------------------


@given(case=meta_cases(), dtype=st.sampled_from([torch.int64, torch.int32]))
def test_prepare_matches_the_plain_model(case, dtype):
    slots, L, M_max = case
    meta = prepared(slots, L, M_max, dtype)
    assert_same(snapshot(meta), as_dict(plain_meta(slots, L, M_max)), f"T={len(slots)} L={L}: ")


@pytest.mark.parametrize("mode", MODES)
@given(
    T=st.integers(0, META_LIMITS.tokens),
    L=st.integers(1, META_LIMITS.loras),
    seed=st.integers(0, 2**32 - 1),
)
def test_prepare_matches_the_plain_model_in_every_mode(mode, T, L, seed):
    # The same property, with every assignment mode getting its full share of examples.
    slots = assign_slots(mode, T, L, seed)
    meta = prepared(slots, L, T + 3)
    assert_same(snapshot(meta), as_dict(plain_meta(slots, L, T + 3)), f"{mode} T={T} L={L}: ")


@given(case=meta_cases())
def test_buffers_have_vllm_dtypes_shapes_and_devices(case):
    slots, L, M_max = case
    meta = prepared(slots, L, M_max)
    shapes = {
        "token_lora_mapping": (M_max,),
        "token_indices_sorted_by_lora_ids": (M_max,),
        "num_tokens_per_lora": (L + 1,),
        "lora_token_start_loc": (L + 2,),
        "active_lora_ids": (L + 1,),
    }
    for name, shape in shapes.items():
        buf = getattr(meta, name)
        assert buf.dtype == torch.int32, f"{name}: dtype {buf.dtype}"
        assert tuple(buf.shape) == shape, f"{name}: shape {tuple(buf.shape)}, expected {shape}"
        assert buf.device.type == torch.device(DEVICE).type, f"{name} on {buf.device}"
    flag = meta.no_lora_flag_cpu
    assert flag.dtype == torch.bool and tuple(flag.shape) == (1,)
    assert flag.device.type == "cpu", f"the flag must live on the CPU, found {flag.device}"
    assert (meta.max_loras, meta.max_num_tokens) == (L, M_max)
    assert isinstance(meta.num_tokens, int) and isinstance(meta.max_slot_in_use, int)
    assert meta.num_tokens == len(slots)
    assert meta.max_slot_in_use == max(slots, default=-1)
    # The ops read the same host-side facts from the ids tensor that meta_args hands them.
    facts = host_facts_of(meta.meta_args(len(slots))[4])
    assert facts is not None, "meta_args's active_lora_ids lost its host-side facts"
    assert (facts.num_tokens, facts.max_slot_in_use) == (len(slots), max(slots, default=-1))


@given(case=meta_cases())
def test_sorted_indices_are_a_stable_permutation(case):
    slots, L, M_max = case
    T = len(slots)
    order = prepared(slots, L, M_max).token_indices_sorted_by_lora_ids.tolist()[:T]
    assert sorted(order) == list(range(T)), f"first T={T} sorted indices: {order}"
    if any(s != -1 for s in slots):  # with no LoRA at all the buffer stays the identity
        for a, b in zip(order, order[1:]):
            assert (slots[a], a) < (slots[b], b), (
                f"not a stable sort by slot: token {a} (slot {slots[a]}) before "
                f"token {b} (slot {slots[b]})"
            )


@given(case=meta_cases())
def test_each_segment_holds_its_slots_tokens_in_order(case):
    slots, L, M_max = case
    T = len(slots)
    meta = prepared(slots, L, M_max)
    ids = meta.active_lora_ids.tolist()
    counts = meta.num_tokens_per_lora.tolist()
    starts = meta.lora_token_start_loc.tolist()
    order = meta.token_indices_sorted_by_lora_ids.tolist()
    in_lora_segments = []
    for slot, start, count in zip(ids, starts, counts):
        if count == 0:
            continue
        segment = order[start : start + count]
        want = [t for t in range(T) if slots[t] == slot]  # its tokens, original order
        assert segment == want, f"segment of slot {slot} at {start}: {segment}, expected {want}"
        if slot != -1:
            in_lora_segments += segment
    # Every token with a LoRA is in exactly one LoRA segment; -1 tokens are in none.
    assert sorted(in_lora_segments) == [t for t in range(T) if slots[t] != -1]
    # The host-side read-back agrees with the same model.
    want_segments = []
    if any(s != -1 for s in slots):
        sorted_order, model_ids, model_counts, model_starts = plain_segments(slots)
        for slot, start, count in zip(model_ids, model_starts, model_counts):
            tokens = tuple(sorted_order[start : start + count])
            want_segments.append(Segment(slot, start, count, tokens))
    assert meta.segments() == want_segments


@given(case=meta_cases())
def test_counts_starts_and_ids_agree(case):
    slots, L, M_max = case
    T = len(slots)
    meta = prepared(slots, L, M_max)
    ids = meta.active_lora_ids.tolist()
    counts = meta.num_tokens_per_lora.tolist()
    starts = meta.lora_token_start_loc.tolist()
    used = 0 if all(s == -1 for s in slots) else len(set(slots))
    assert starts[0] == 0
    for i in range(used):
        assert counts[i] > 0, f"used entry {i} (slot {ids[i]}) has count {counts[i]}"
        assert starts[i + 1] == starts[i] + counts[i], f"starts {starts} vs counts {counts}"
    if used:
        assert starts[used] == T, f"the segments cover {starts[used]} of {T} tokens"
    if used:  # ascending, -1 first when present
        assert ids[:used] == sorted(set(slots)), f"active ids {ids[:used]}"
    assert all(i == -1 for i in ids[used:]), f"unused ids {ids[used:]}"
    assert all(c == 0 for c in counts[used:]), f"unused counts {counts[used:]}"
    assert all(s == 0 for s in starts[used + 1 :]), f"unused starts {starts[used + 1 :]}"
    assert meta.no_lora_flag_cpu.item() is (used == 0)


@given(
    before=meta_cases(),
    T=st.integers(0, META_LIMITS.tokens),
)
def test_no_lora_leaves_every_buffer_at_its_reset_value(before, T):
    slots_before, L, M_max = before
    M_max = max(M_max, T)
    meta = prepared(slots_before, L, M_max)  # leave something behind first
    meta.prepare_tensors(mapping_tensor([-1] * T))
    fresh = LoRAKernelMeta.make(L, M_max, DEVICE)
    fresh_state = snapshot(fresh) | {"num_tokens": T}
    assert_same(snapshot(meta), fresh_state, "all -1 after a batch vs a fresh meta: ")
    assert fresh_state["token_lora_mapping"] == [-1] * M_max
    assert fresh_state["token_indices_sorted_by_lora_ids"] == list(range(M_max))
    assert fresh_state["active_lora_ids"] == [-1] * (L + 1)
    assert fresh_state["num_tokens_per_lora"] == [0] * (L + 1)
    assert fresh_state["lora_token_start_loc"] == [0] * (L + 2)
    assert fresh_state["no_lora_flag_cpu"] == [True]
    assert meta.max_slot_in_use == -1


@given(case=meta_cases(), data=st.data())
def test_meta_args_slices_the_token_buffers(case, data):
    slots, L, M_max = case
    T = len(slots)
    meta = prepared(slots, L, M_max)
    token_nums = data.draw(st.integers(T, M_max), label="token_nums (with graph padding)")
    args = meta.meta_args(token_nums)
    assert isinstance(args, tuple) and len(args) == 6
    mapping, order, counts, starts, ids, flag = args
    want = plain_meta(slots, L, M_max)
    assert mapping.tolist() == want.token_lora_mapping[:token_nums]
    assert order.tolist() == want.token_indices_sorted_by_lora_ids[:token_nums]
    # The slices are views of the buffers (a CUDA graph reads the buffers themselves).
    assert shares_memory(mapping, meta.token_lora_mapping)
    assert shares_memory(order, meta.token_indices_sorted_by_lora_ids)
    for got, name in zip(
        (counts, starts, ids), ("num_tokens_per_lora", "lora_token_start_loc", "active_lora_ids")
    ):
        buf = getattr(meta, name)
        assert got.shape == buf.shape and shares_memory(got, buf), name
        assert got.tolist() == getattr(want, name), name
    assert flag is meta.no_lora_flag_cpu
    # Padded rows T..token_nums are in no segment.
    segment_tokens = [
        t
        for start, count in zip(starts.tolist(), counts.tolist())
        for t in order.tolist()[start : start + count]
    ]
    assert all(t < T for t in segment_tokens), f"a padded row is in a segment: {segment_tokens}"
    with pytest.raises(ValueError, match="max_num_tokens"):
        meta.meta_args(M_max + 1)


@st.composite
def batch_sequences(draw):
    """L, then 2-4 batches of varying size (shrinking and growing), then spare capacity."""
    L = draw(st.integers(1, META_LIMITS.loras), label="L")
    sizes = draw(st.lists(st.integers(0, META_LIMITS.tokens), min_size=2, max_size=4), label="Ts")
    batches = [draw(slot_lists(T, L), label=f"batch {i}") for i, T in enumerate(sizes)]
    spare = draw(st.sampled_from([0, 5]), label="spare capacity")
    return batches, L, max(sizes) + spare


@given(case=batch_sequences())
def test_reused_meta_shows_no_stale_state(case):
    batches, L, M_max = case
    meta = LoRAKernelMeta.make(L, M_max, DEVICE)
    for step, slots in enumerate(batches):
        meta.prepare_tensors(mapping_tensor(slots))
        fresh = prepared(slots, L, M_max)
        context = f"step {step} (T={len(slots)}, after {[len(b) for b in batches[:step]]}): "
        assert_same(snapshot(meta), snapshot(fresh), context + "reused vs fresh: ")
        assert_same(snapshot(meta), as_dict(plain_meta(slots, L, M_max)), context)
        facts = host_facts_of(meta.active_lora_ids)
        assert (facts.num_tokens, facts.max_slot_in_use) == (len(slots), max(slots, default=-1))


def plain_tile_table(slots: list[int], tile_m: int, num_blocks: int) -> list[list[int]]:
    """The tile table, row by row (a row per block), from a walk over the plain model's
    segments."""
    table = []
    if any(s != -1 for s in slots):  # else no segment at all: every block exits
        order, ids, counts, starts = plain_segments(slots)
        for slot, count, start in zip(ids, counts, starts):
            if slot == -1:
                continue
            for first in range(0, count, tile_m):
                position = start + first
                table.append([slot, position, min(tile_m, count - first), order[position]])
    assert len(table) <= num_blocks, "the grid bound is too small"
    return table + [[-1, 0, 0, 0]] * (num_blocks - len(table))


def plain_tile_tokens(slots: list[int], table: list[list[int]], tile_m: int) -> list[list[int]]:
    """Each tile's tokens, row by row: its ``rows`` sorted tokens, then the last of them
    again up to ``tile_m``; zeros for a block with no tile."""
    order = plain_segments(slots)[0] if any(s != -1 for s in slots) else []
    rows = []
    for _, position, count, _ in table:
        tokens = order[position : position + count]
        rows.append(tokens + tokens[-1:] * (tile_m - count) if count else [0] * tile_m)
    return rows


#: The tiles whose tokens a kernel reads from rows of their own: the unstaged tensor-core
#: expand's (the staged one reads the sorted tokens).
READ_TOKEN_TILES = {
    c.tile_m for c in launch_configs("expand") if c.kernel == "mma" and not c.staged
}


@given(case=batch_sequences())
def test_tile_tables_match_a_walk_over_the_segments(case):
    """After every prepare, each table the meta keeps (one per tile size) holds, for
    block b, tile b's slot, sorted position, row count and first token, and (for the
    tile sizes whose tokens a kernel reads) row b of its tile tokens the tile's tokens;
    and tables made from vLLM's six tensors alone (the ops' path for other metadata)
    agree."""
    batches, L, M_max = case
    meta = LoRAKernelMeta.make(L, M_max, DEVICE)
    for step, slots in enumerate(batches):
        meta.prepare_tensors(mapping_tensor(slots))
        _, order, counts, starts, ids, _ = meta.meta_args(len(slots))
        facts = host_facts_of(meta.active_lora_ids)
        # tile tokens only for the sizes whose tokens a kernel reads (the tensor-core expand's)
        assert set(facts.tile_tokens) == READ_TOKEN_TILES
        for tile_m, table in facts.tile_tables.items():
            want = plain_tile_table(slots, tile_m, table.shape[0])
            context = f"step {step}, tile_m={tile_m}, slots={slots}"
            assert table.tolist() == want, context
            want_tokens = plain_tile_tokens(slots, want, tile_m)
            if tile_m in facts.tile_tokens:
                assert facts.tile_tokens[tile_m].tolist() == want_tokens, context
            if any(s != -1 for s in slots):
                made = tile_table(ids, counts, starts, order, tile_m, table.shape[0])
                assert made.tolist() == want, context
                assert tile_tokens(made, order, tile_m).tolist() == want_tokens, context


BAD_CALLS = ("too many tokens", "slot below -1", "slot >= L", "2-D", "float", "list")


@given(case=meta_cases(), bad=st.sampled_from(BAD_CALLS), data=st.data())
def test_a_rejected_call_changes_nothing(case, bad, data):
    slots, L, M_max = case
    meta = prepared(slots, L, M_max)
    before = snapshot(meta)
    # The rejected batch: valid slots with one bad entry (or a bad container).
    T = data.draw(st.integers(1, M_max + 1), label="rejected T")
    rejected = data.draw(slot_lists(T, L), label="rejected slots")
    where = data.draw(st.integers(0, T - 1), label="bad position")
    error, message = ValueError, None
    if bad == "too many tokens":
        rejected = data.draw(slot_lists(M_max + 1, L), label="oversize slots")
        argument, message = mapping_tensor(rejected), "max_num_tokens"
    elif bad == "slot below -1":
        rejected[where] = data.draw(st.integers(-1000, -2), label="bad slot")
        argument = mapping_tensor(rejected)
    elif bad == "slot >= L":
        rejected[where] = data.draw(st.integers(L, L + 1000), label="bad slot")
        argument = mapping_tensor(rejected)
    elif bad == "2-D":
        argument = mapping_tensor(rejected).reshape(1, T)
    elif bad == "float":
        argument = mapping_tensor(rejected).to(torch.float32)
    else:
        argument, error = rejected, TypeError
    with pytest.raises(error, match=message):
        meta.prepare_tensors(argument)
    assert_same(snapshot(meta), before, f"after a rejected call ({bad}): ")


# -- prepare_slots: the same metadata, made on the host and sent ---------------------------


def full_snapshot(meta: LoRAKernelMeta) -> dict:
    """:func:`snapshot`, and everything else the kernels and the ops read: the tile tables
    and tile tokens, vLLM 0.33's ``num_active_loras`` and the host's facts."""
    out = snapshot(meta)
    facts = host_facts_of(meta.active_lora_ids)
    out["tile_tables"] = {m: t.tolist() for m, t in facts.tile_tables.items()}
    out["tile_tokens"] = {m: t.tolist() for m, t in facts.tile_tokens.items()}
    out["num_active_loras_cpu"] = meta.num_active_loras_cpu.tolist()
    out["facts"] = (facts.num_tokens, facts.max_slot_in_use, facts.active_slots, facts.segments)
    return out


SLOT_FORMS = ("list", "numpy int64", "CPU tensor int32")


def host_slots(slots: list[int], form: str):
    """The slots as the host may hold them."""
    if form == "list":
        return list(slots)
    if form == "numpy int64":
        return np.array(slots, dtype=np.int64)
    return torch.tensor(slots, dtype=torch.int32).reshape(len(slots))


@given(case=batch_sequences(), data=st.data())
def test_prepare_slots_gives_what_prepare_tensors_gives(case, data):
    """A meta with a host twin (on the simulator too: there the twin's buffers are copied
    as on a GPU), fed step after step by prepare_slots, holds after each step exactly what
    a meta fed by prepare_tensors holds."""
    batches, L, M_max = case
    staged = LoRAKernelMeta.make(L, M_max, DEVICE, host_twin=True)
    plain = LoRAKernelMeta.make(L, M_max, DEVICE)
    for step, slots in enumerate(batches):
        form = data.draw(st.sampled_from(SLOT_FORMS), label=f"form {step}")
        staged.prepare_slots(host_slots(slots, form))
        plain.prepare_tensors(mapping_tensor(slots))
        got, want = full_snapshot(staged), full_snapshot(plain)
        context = f"step {step} ({form}, slots={slots}): "
        assert_same(got, want, context)
        for name in ("tile_tables", "tile_tokens", "num_active_loras_cpu", "facts"):
            assert got[name] == want[name], context + name


@given(case=meta_cases(), bad=st.sampled_from(BAD_CALLS[:3]), data=st.data())
def test_prepare_slots_rejects_what_prepare_tensors_rejects_and_changes_nothing(case, bad, data):
    slots, L, M_max = case
    meta = LoRAKernelMeta.make(L, M_max, DEVICE, host_twin=True)
    meta.prepare_slots(slots)
    before = full_snapshot(meta)
    T = data.draw(st.integers(1, M_max + 1), label="rejected T")
    rejected = data.draw(slot_lists(T, L), label="rejected slots")
    where = data.draw(st.integers(0, T - 1), label="bad position")
    message = "slots must lie"
    if bad == "too many tokens":
        rejected = data.draw(slot_lists(M_max + 1, L), label="oversize slots")
        message = "max_num_tokens"
    elif bad == "slot below -1":
        rejected[where] = data.draw(st.integers(-1000, -2), label="bad slot")
    else:
        rejected[where] = data.draw(st.integers(L, L + 1000), label="bad slot")
    if len(rejected) > M_max:  # (the size is checked first)
        message = "max_num_tokens"
    with pytest.raises(ValueError, match=message):
        meta.prepare_slots(rejected)
    assert full_snapshot(meta) == before, f"after a rejected call ({bad})"


@pytest.mark.parametrize(
    "slots",
    [np.zeros((1, 2), dtype=np.int64), np.array([0.0, 1.0]), [True, False], [0, None]],
    ids=["2-D", "float", "bool", "None entry"],
)
def test_prepare_slots_rejects_what_is_not_a_row_of_integers_and_changes_nothing(slots):
    meta = LoRAKernelMeta.make(2, 8, DEVICE, host_twin=True)
    meta.prepare_slots([1, -1, 0])
    before = full_snapshot(meta)
    with pytest.raises(ValueError, match="slots must be a 1-D sequence of integers"):
        meta.prepare_slots(slots)
    assert full_snapshot(meta) == before


@pytest.mark.gpu
def test_prepare_slots_takes_host_data_into_page_locked_twins():
    """On a GPU every twin buffer is page-locked (so its copy is asynchronous), and slots
    on the device are refused (prepare_tensors takes those)."""
    meta = LoRAKernelMeta.make(2, 8, DEVICE)
    assert all(twin.is_pinned() for twin in meta._twin._device_buffers())
    with pytest.raises(ValueError, match="prepare_slots takes slots the host holds"):
        meta.prepare_slots(torch.tensor([0, 1], device=DEVICE))


# -- examples -----------------------------------------------------------------------------


def test_spec_example():
    meta = LoRAKernelMeta.make(4, 8, DEVICE)
    meta.prepare_tensors(mapping_tensor([1, -1, 0, 1, -1]))
    assert meta.token_indices_sorted_by_lora_ids.tolist()[:5] == [1, 4, 2, 0, 3]
    assert meta.token_indices_sorted_by_lora_ids.tolist()[5:] == [5, 6, 7]
    assert meta.active_lora_ids.tolist() == [-1, 0, 1, -1, -1]
    assert meta.num_tokens_per_lora.tolist() == [2, 1, 2, 0, 0]
    assert meta.lora_token_start_loc.tolist() == [0, 2, 3, 5, 0, 0]
    assert meta.token_lora_mapping.tolist() == [1, -1, 0, 1, -1, -1, -1, -1]
    assert meta.no_lora_flag_cpu.tolist() == [False]
    assert (meta.num_tokens, meta.max_slot_in_use) == (5, 1)


@pytest.mark.parametrize(
    "slots, L",
    [
        ([], 1),  # no tokens
        ([0], 1),  # one token, one slot
        ([-1], 3),  # one token, no LoRA
        ([-1] * 17, 2),  # no token has a LoRA
        ([3, 2, 1, 0], 4),  # every token on a different slot, in reverse
        ([15] * 300, 16),  # every token on the last slot, full size
    ],
)
def test_awkward_sizes(slots, L):
    M_max = max(len(slots), 1) + 3
    meta = prepared(slots, L, M_max)
    assert_same(snapshot(meta), as_dict(plain_meta(slots, L, M_max)))


def test_make_starts_in_the_reset_state():
    meta = LoRAKernelMeta.make(3, 5, DEVICE)
    assert_same(snapshot(meta), as_dict(plain_meta([], 3, 5)))


_ROW = re.compile(r"^\| (-?\d+)(?: \(no LoRA\))? \| (\d+) \| (\d+) \| (.*) \|$")


@given(case=meta_cases())
def test_markdown_repr_has_a_row_per_non_empty_segment(case):
    slots, L, M_max = case
    text = prepared(slots, L, M_max)._repr_markdown_()
    rows = [m.groups() for m in map(_ROW.match, text.splitlines()) if m]
    want, order = [], []
    if any(s != -1 for s in slots):
        order, ids, counts, starts = plain_segments(slots)
        want = [(str(i), str(s), str(c)) for i, s, c in zip(ids, starts, counts)]
    assert [r[:3] for r in rows] == want, text
    for (_, start, count, shown), _w in zip(rows, want):
        first = [int(t) for t in shown.replace(", …", "").split(", ")]
        assert first == order[int(start) : int(start) + len(first)], shown
        assert (len(first) < int(count)) == shown.endswith("…"), shown
    assert f"{len(slots)} tokens" in text
