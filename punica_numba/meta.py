"""Sort and segment: ``LoRAKernelMeta``, the metadata every kernel launch reads.

The kernels do not walk tokens in their original order. They walk *segments*:
the tokens sorted (stably) by their slot, so that every slot's tokens sit next
to each other and one block can reuse a slot's weights across them.

Example: the token slots ``[1, -1, 0, 1, -1]`` give

=====================================  =========================
``token_indices_sorted_by_lora_ids``   ``[1, 4, 2, 0, 3]``
``active_lora_ids``                    ``[-1, 0, 1, -1, ...]``
``num_tokens_per_lora``                ``[2, 1, 2, 0, ...]``
``lora_token_start_loc``               ``[0, 2, 3, 5, 0, ...]``
=====================================  =========================

so segment i, ``sorted[start[i] : start[i] + count[i]]``, holds exactly the tokens
of slot ``active_lora_ids[i]`` in their original order. The field names, shapes and
dtypes are vLLM's (../shared/SPEC.md §3); unlike vLLM's, every buffer is
initialised, bad slots and oversize batches raise ``ValueError``, and the largest
slot in use is kept on the host so that later checks need no device sync.

``meta_args`` speaks both of vLLM's conventions: ``meta_args(T)`` gives the six values
of vLLM v0.8-v0.9; ``meta_args(T, specialize_active_lora)`` the seven of vLLM 0.33, whose
last, ``num_active_loras``, says how many leading entries of ``active_lora_ids`` the
kernels must look at (vLLM sizes its grid's LoRA axis by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._checks import check_bool, check_device, check_int
from .host_meta import host_slots, prepare_on_host
from .kernels.segments import (
    TABLE_FIELDS,
    clear_tile_table,
    tile_grid_bound,
    tile_table,
    tile_tokens,
)
from .launch import tile_sizes, tile_token_sizes
from .staging import HostStaging, pinned_for, separate_twins

__all__ = ["HostFacts", "LoRAKernelMeta", "Segment", "host_facts_of"]


@dataclass
class HostFacts:
    """What a ``LoRAKernelMeta`` knows beyond vLLM's six tensors.

    Host-side numbers about the last prepared mapping, so checks and the choice of a
    launch configuration need no device sync; and the device tile tables and tile tokens
    the kernels read (:mod:`punica_numba.kernels.segments`). It is shared by the meta and its
    ``active_lora_ids`` tensor, so the ops find it from the tensors ``meta_args``
    hands them (see :func:`host_facts_of`).
    """

    num_tokens: int = 0  # tokens in the last prepared mapping
    max_slot_in_use: int = -1  # the largest slot in it, -1 if none
    active_slots: int = 0  # distinct slots other than -1 in it
    segments: int = 0  # entries of active_lora_ids in use: active_slots, +1 if a token has -1
    tile_tables: dict = field(default_factory=dict)  # tile_m -> [bound, 4] int32 (device)
    tile_tokens: dict = field(default_factory=dict)  # launch.tile_token_sizes() -> [bound, tile_m]
    # the kernels' metadata arguments (the table and the sorted or tile tokens), described
    # once, by tile_m or (tile_m, "rows") (see ops.launching.kernel_metadata)
    kernel_metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Segment:
    """One run of sorted tokens that share a slot (read back to the host)."""

    slot: int
    start: int
    count: int
    tokens: tuple[int, ...]


@dataclass
class LoRAKernelMeta:
    """Token-to-slot metadata in fixed-size buffers, ready for kernel launches.

    Attributes:
        token_lora_mapping: ``[M_max]`` int32, slot of each token, -1 = none (and past
            the prepared tokens).
        token_indices_sorted_by_lora_ids: ``[M_max]`` int32, a stable sort of the
            tokens by slot; past the prepared tokens, the identity.
        active_lora_ids: ``[L+1]`` int32, the distinct slots present, ascending, -1
            first if present; unused entries -1.
        num_tokens_per_lora: ``[L+1]`` int32, tokens of ``active_lora_ids[i]``; unused 0.
        lora_token_start_loc: ``[L+2]`` int32, ``[0, cumsum(counts)]``; unused 0.
        no_lora_flag_cpu: ``[1]`` bool on the CPU, True iff no token has a LoRA.
        num_active_loras_cpu: ``[1]`` int32 on the CPU, the entries of ``active_lora_ids``
            in use (vLLM 0.33's ``num_active_loras`` under ``specialize_active_lora``).
        all_loras_cpu: ``[1]`` int32 on the CPU holding L+1, every entry (vLLM 0.33's
            ``num_active_loras`` without ``specialize_active_lora``).
        max_loras: L, the number of slots.
        max_num_tokens: M_max, the most tokens a mapping may hold.
        host: what the host knows of the last prepared mapping (:class:`HostFacts`).
    """

    token_lora_mapping: torch.Tensor
    token_indices_sorted_by_lora_ids: torch.Tensor
    active_lora_ids: torch.Tensor
    num_tokens_per_lora: torch.Tensor
    lora_token_start_loc: torch.Tensor
    no_lora_flag_cpu: torch.Tensor
    num_active_loras_cpu: torch.Tensor
    all_loras_cpu: torch.Tensor
    max_loras: int
    max_num_tokens: int
    host: HostFacts = field(default_factory=HostFacts)
    _positions: torch.Tensor = field(repr=False, default=None)  # [M_max] int32 arange
    # prepare_slots: a copy of this metadata on the host that computes it, and the copies
    # that send its buffers here (None: the buffers are on the host already).
    _twin: LoRAKernelMeta | None = field(repr=False, default=None)
    _staging: HostStaging | None = field(repr=False, default=None)

    @staticmethod
    def make(
        max_loras: int,
        max_num_tokens: int,
        device: torch.device | str,
        *,
        host_twin: bool | None = None,
    ) -> LoRAKernelMeta:
        """Allocate and initialise the buffers for L slots and up to M_max tokens.

        ``host_twin``: keep a copy of the buffers on the host, where
        :meth:`prepare_slots` computes the metadata (default: where ``device`` is not
        the CPU; on the CPU the buffers are their own host copy, and a twin there only
        serves to test the copying path).
        """
        max_loras = check_int("max_loras", max_loras, minimum=1)
        max_num_tokens = check_int("max_num_tokens", max_num_tokens, minimum=0)
        device = check_device("device", device)
        if host_twin is None:
            host_twin = separate_twins(device)
        host_twin = check_bool("host_twin", host_twin)
        meta = LoRAKernelMeta._allocate(max_loras, max_num_tokens, device)
        if host_twin:
            twin = LoRAKernelMeta._allocate(
                max_loras, max_num_tokens, torch.device("cpu"), pin_memory=pinned_for(device)
            )
            meta._twin = twin
            meta._staging = HostStaging(list(zip(meta._device_buffers(), twin._device_buffers())))
        return meta

    @staticmethod
    def _allocate(
        max_loras: int, max_num_tokens: int, device: torch.device, pin_memory: bool = False
    ) -> LoRAKernelMeta:
        """The buffers of :meth:`make`, initialised, on ``device`` (page-locked CPU memory
        with ``pin_memory``); no twin."""
        i32 = dict(dtype=torch.int32, device=device, pin_memory=pin_memory)
        positions = torch.arange(max_num_tokens, **i32)  # [M_max]
        meta = LoRAKernelMeta(
            token_lora_mapping=torch.full((max_num_tokens,), -1, **i32),
            token_indices_sorted_by_lora_ids=torch.arange(max_num_tokens, **i32),  # (pinned too)
            active_lora_ids=torch.full((max_loras + 1,), -1, **i32),
            num_tokens_per_lora=torch.zeros(max_loras + 1, **i32),
            lora_token_start_loc=torch.zeros(max_loras + 2, **i32),
            no_lora_flag_cpu=torch.ones(1, dtype=torch.bool, device="cpu"),
            num_active_loras_cpu=torch.zeros(1, dtype=torch.int32, device="cpu"),
            all_loras_cpu=torch.full((1,), max_loras + 1, dtype=torch.int32, device="cpu"),
            max_loras=max_loras,
            max_num_tokens=max_num_tokens,
            _positions=positions,
        )
        for tile_m in tile_sizes():  # [bound, 4] each: no tile anywhere yet
            bound = tile_grid_bound(max_num_tokens, max_loras + 1, tile_m)
            table = torch.empty((bound, len(TABLE_FIELDS)), **i32)
            meta.host.tile_tables[tile_m] = clear_tile_table(table)
        for tile_m in tile_token_sizes():  # each tile's tokens, for the kernels that read them
            bound = meta.host.tile_tables[tile_m].shape[0]
            meta.host.tile_tokens[tile_m] = torch.zeros((bound, tile_m), **i32)
        # Let the ops find the host-side facts from the tensors they are handed.
        meta.active_lora_ids._punica_host_facts = meta.host
        return meta

    def _device_buffers(self) -> list[torch.Tensor]:
        """Every buffer the kernels read, in one order (prepare_tensors rewrites them all)."""
        return [
            self.token_lora_mapping,
            self.token_indices_sorted_by_lora_ids,
            self.active_lora_ids,
            self.num_tokens_per_lora,
            self.lora_token_start_loc,
            *(self.host.tile_tables[m] for m in sorted(self.host.tile_tables)),
            *(self.host.tile_tokens[m] for m in sorted(self.host.tile_tokens)),
        ]

    @property
    def num_tokens(self) -> int:
        """Tokens in the last prepared mapping (host)."""
        return self.host.num_tokens

    @property
    def max_slot_in_use(self) -> int:
        """The largest slot in the last prepared mapping, -1 if none (host)."""
        return self.host.max_slot_in_use

    def _reset(self, num_tokens: int) -> None:
        self.token_lora_mapping.fill_(-1)
        self.token_indices_sorted_by_lora_ids.copy_(self._positions)
        self.active_lora_ids.fill_(-1)
        self.num_tokens_per_lora.fill_(0)
        self.lora_token_start_loc.fill_(0)
        self.no_lora_flag_cpu.fill_(True)
        self.num_active_loras_cpu.fill_(0)
        self.host.num_tokens = num_tokens
        self.host.max_slot_in_use = -1
        self.host.active_slots = 0
        self.host.segments = 0
        for table in self.host.tile_tables.values():
            clear_tile_table(table)
        for tokens in self.host.tile_tokens.values():
            tokens.zero_()

    def prepare_tensors(self, token_lora_mapping: torch.Tensor) -> None:
        """Sort and segment the tokens of one step.

        Semantics:
            mapping: [n] integer slots in [-1, L), n <= M_max (any device; copied).
            token_lora_mapping[:n] = mapping;        rest -1
            sorted[:n] = stable argsort(mapping);    rest = identity
            active ids, counts, starts as in the module docstring;
            no_lora_flag_cpu = all(mapping == -1)
        Reads one pair of numbers back to the host (min and max) to validate.

        Raises:
            ValueError: more than ``max_num_tokens`` tokens, a slot outside
                ``[-1, max_loras)``, or a mapping that is not a 1-D integer tensor.
            TypeError: a mapping that is not a tensor.
        """
        mapping = token_lora_mapping
        if not isinstance(mapping, torch.Tensor):
            raise TypeError(
                f"token_lora_mapping must be a torch.Tensor, got {type(mapping).__name__}"
            )
        if mapping.ndim != 1 or mapping.dtype.is_floating_point or mapping.dtype == torch.bool:
            raise ValueError(
                "token_lora_mapping must be a 1-D integer tensor, got "
                f"{mapping.dtype} of shape {tuple(mapping.shape)}"
            )
        if mapping.device.type == "meta":
            raise ValueError("token_lora_mapping must hold real data, got a meta-device tensor")
        n = mapping.numel()
        if n > self.max_num_tokens:
            raise ValueError(
                f"token_lora_mapping holds {n} tokens but this metadata was made for at most "
                f"max_num_tokens={self.max_num_tokens}"
            )
        device = self.token_lora_mapping.device
        mapping = mapping.to(device=device, dtype=torch.int64)
        # counts[j] = tokens of slot j - 1, for slots -1 .. L-1  -> [L+1]
        counts = torch.bincount(
            (mapping + 1).clamp(0, self.max_loras), minlength=self.max_loras + 1
        )
        present = counts > 0
        if n:  # one sync reads all the host needs: the range and how many slots are used
            lowest, highest, used_slots = torch.stack(
                [*torch.aminmax(mapping), present[1:].sum()]
            ).tolist()
            if lowest < -1 or highest >= self.max_loras:
                raise ValueError(
                    f"token_lora_mapping holds slots from {lowest} to {highest}; slots must lie "
                    f"in [-1, max_loras={self.max_loras})"
                )
        else:
            lowest, highest, used_slots = -1, -1, 0

        self._reset(n)
        self.token_lora_mapping[:n].copy_(mapping)
        self.host.max_slot_in_use = highest
        self.host.active_slots = used_slots
        self.host.segments = used_slots + int(n > 0 and lowest == -1)
        self.num_active_loras_cpu.fill_(self.host.segments)
        if highest == -1:  # no token has a LoRA: every segment stays empty
            return
        self.no_lora_flag_cpu.fill_(False)

        order = torch.sort(mapping, stable=True).indices  # [n], -1 tokens first
        self.token_indices_sorted_by_lora_ids[:n].copy_(order)

        # The present slots first (ascending), then the absent ones: no sync needed.
        order_present = torch.sort((~present).to(torch.int8), stable=True).indices  # [L+1]
        used = torch.arange(self.max_loras + 1, device=device) < present.sum()  # [L+1]
        self.active_lora_ids.copy_(torch.where(used, order_present - 1, -1))
        compact_counts = torch.where(used, counts[order_present], 0)  # [L+1]
        self.num_tokens_per_lora.copy_(compact_counts)
        self.lora_token_start_loc[1:].copy_(torch.where(used, compact_counts.cumsum(0), 0))
        for tile_m, table in self.host.tile_tables.items():
            tile_table(
                self.active_lora_ids,
                compact_counts,
                self.lora_token_start_loc,
                self.token_indices_sorted_by_lora_ids,
                tile_m,
                table.shape[0],
                out=table,
            )
            tokens = self.host.tile_tokens.get(tile_m)
            if tokens is not None:
                tile_tokens(table, self.token_indices_sorted_by_lora_ids, tile_m, out=tokens)

    def prepare_slots(self, slots) -> None:
        """:meth:`prepare_tensors` for slots the host holds: the same metadata, made on the host.

        Semantics:
            slots: [n] integer slots in [-1, L): a CPU tensor, a numpy array or a
                sequence of ints (what ``convert_mapping`` makes from a ``LoRAMapping``).
            afterwards every buffer holds what prepare_tensors(slots) would give.

        The metadata is computed by NumPy on the host (:mod:`punica_numba.host_meta`),
        into the buffers themselves where they are on the CPU, and on a GPU into a
        page-locked twin of them, whose buffers are then sent with one asynchronous copy
        each on the current stream (:mod:`punica_numba.staging`): no kernel and no device
        sync, where :meth:`prepare_tensors` on the GPU runs 214 small torch operations
        (views among them) and reads two numbers back. Work queued on the stream before
        this call still reads the old metadata; work queued after, the new.

        Raises:
            ValueError: a tensor not on the CPU (use :meth:`prepare_tensors` for device
                data), slots that are not 1-D integers, and what :meth:`prepare_tensors`
                rejects. Nothing is changed then.
        """
        mapping, lowest, highest = host_slots(slots, self.max_loras, self.max_num_tokens)
        if self._twin is None:
            prepare_on_host(self, mapping, lowest, highest)
            return
        twin = self._twin
        self._staging.wait()  # (its last copies are done: the twin may be written)
        prepare_on_host(twin, mapping, lowest, highest)
        self._staging.send()
        self.no_lora_flag_cpu.copy_(twin.no_lora_flag_cpu)
        self.num_active_loras_cpu.copy_(twin.num_active_loras_cpu)
        for name in ("num_tokens", "max_slot_in_use", "active_slots", "segments"):
            setattr(self.host, name, getattr(twin.host, name))

    def meta_args(self, token_nums: int, specialize_active_lora: bool | None = None) -> tuple:
        """The metadata arguments of ``lora_shrink`` / ``lora_expand``, for ``token_nums`` rows.

        ``meta_args(T)`` gives the six values of vLLM v0.8-v0.9::

            (token_lora_mapping[:T], token_indices_sorted_by_lora_ids[:T],
             num_tokens_per_lora, lora_token_start_loc, active_lora_ids, no_lora_flag_cpu)

        ``meta_args(T, specialize_active_lora)``, with a bool, gives vLLM 0.33's seven: the
        same six, then ``num_active_loras``, a one-element int32 CPU tensor: the entries of
        ``active_lora_ids`` in use when ``specialize_active_lora`` (the distinct slots of
        the mapping, -1 counted when a token has none), else all ``max_loras + 1`` of them.
        Both tensors are this metadata's own: the first is refilled by every
        ``prepare_tensors``, so a value read later is the later mapping's.

        ``token_nums`` is the row count of the activation, which may exceed the prepared
        token count (CUDA-graph padding); rows past the prepared tokens are in no segment.
        No device sync.
        """
        token_nums = check_int("token_nums", token_nums, minimum=0)
        if token_nums > self.max_num_tokens:
            raise ValueError(
                f"token_nums={token_nums} exceeds this metadata's max_num_tokens="
                f"{self.max_num_tokens}"
            )
        six = (
            self.token_lora_mapping[:token_nums],
            self.token_indices_sorted_by_lora_ids[:token_nums],
            self.num_tokens_per_lora,
            self.lora_token_start_loc,
            self.active_lora_ids,
            self.no_lora_flag_cpu,
        )
        if specialize_active_lora is None:  # vLLM v0.8-v0.9
            return six
        specialize_active_lora = check_bool("specialize_active_lora", specialize_active_lora)
        return (*six, self.num_active_loras_cpu if specialize_active_lora else self.all_loras_cpu)

    # -- reading it back, for people ------------------------------------------------

    def segments(self) -> list[Segment]:
        """The non-empty segments, read back to the host (syncs; for notebooks and tests)."""
        ids = self.active_lora_ids.tolist()
        counts = self.num_tokens_per_lora.tolist()
        starts = self.lora_token_start_loc.tolist()
        order = self.token_indices_sorted_by_lora_ids.tolist()
        return [
            Segment(slot, start, count, tuple(order[start : start + count]))
            for slot, start, count in zip(ids, starts, counts)
            if count > 0
        ]

    def _table_rows(self, max_tokens_shown: int = 12):
        for seg in self.segments():
            shown = ", ".join(str(t) for t in seg.tokens[:max_tokens_shown])
            if seg.count > max_tokens_shown:
                shown += ", …"
            slot = "-1 (no LoRA)" if seg.slot == -1 else str(seg.slot)
            yield slot, seg.start, seg.count, shown

    def _repr_markdown_(self) -> str:
        head = (
            f"**LoRAKernelMeta**: {self.num_tokens} tokens, {self.max_loras} slots, "
            f"no_lora={bool(self.no_lora_flag_cpu.item())}\n\n"
            "| slot | start | tokens | token indices |\n|---:|---:|---:|:---|\n"
        )
        return head + "".join(f"| {a} | {b} | {c} | {d} |\n" for a, b, c, d in self._table_rows())

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{a}</td><td>{b}</td><td>{c}</td><td>{d}</td></tr>"
            for a, b, c, d in self._table_rows()
        )
        return (
            f"<p><b>LoRAKernelMeta</b>: {self.num_tokens} tokens, {self.max_loras} slots, "
            f"no_lora={bool(self.no_lora_flag_cpu.item())}</p>"
            "<table><tr><th>slot</th><th>start</th><th>tokens</th><th>token indices</th></tr>"
            f"{rows}</table>"
        )


def host_facts_of(lora_ids: torch.Tensor) -> HostFacts | None:
    """The host-side facts of the ``LoRAKernelMeta`` whose ``active_lora_ids`` this is,
    or None for metadata built some other way."""
    return getattr(lora_ids, "_punica_host_facts", None)
