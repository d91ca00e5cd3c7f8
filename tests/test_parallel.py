"""Tensor-parallel LoRA on 2 ranks: every sharded layer must give the unsharded layer's output.

The ranks are real processes (``spawn``), joined by torch.distributed: gloo on
the CPU (the kernels on Numba's simulator) and NCCL on 2 GPUs. All cases run in
one pair of processes, started once for the module, because starting a rank
costs seconds; each case is then its own test. Every rank's output is compared
with the float64 reference of the unsharded layer (``LoRALinear.reference``)
within the bound of tests/tolerance.py, and the ranks must agree bit for bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from punica_numba.parallel import (
    ColumnParallelLinearWithLoRA,
    ColumnParallelLinearWithShardedLoRA,
    LayerCase,
    LoRALinear,
    RankError,
    RowParallelLinearWithLoRA,
    RowParallelLinearWithShardedLoRA,
    qkv_output_slices,
    run_layer_cases,
    run_on_ranks,
    shard,
    shard_index,
    wrapper_for_slots,
)

from .strategies import DEVICE, assign_slots
from .tolerance import assert_close

WORLD = 2


@dataclass(frozen=True)
class Spec:
    """One test case, in words: which layer, how wide, which tokens on which slots."""

    name: str
    kind: str
    slices: tuple[int, ...]
    hidden: int
    rank: int
    loras: int
    tokens: int
    mode: str  # a slot assignment mode of tests/strategies.py
    dtype: torch.dtype
    bias: bool
    shards: tuple[int, ...] | None = None

    def case(self, seed: int) -> LayerCase:
        layer = LoRALinear.random(
            self.slices,
            self.hidden,
            self.rank,
            self.loras,
            dtype=self.dtype,
            seed=seed,
            bias=self.bias,
            scale=0.5,
        )
        gen = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(self.tokens, self.hidden, generator=gen).to(self.dtype)  # [T, H]
        slots = tuple(assign_slots(self.mode, self.tokens, self.loras, seed))
        return LayerCase(self.kind, layer, x, slots, self.shards)

    @property
    def roundings(self) -> int:
        """Roundings to the output dtype: base GEMM, expand, bias, the all-reduce of y."""
        return 2 + int(self.bias) + int(self.kind.startswith("row"))


QKV_GQA, QKV_GQA_SHARDS = qkv_output_slices(4, 2, 2, WORLD)  # (8, 4, 4), 2 shards each
QKV_REP, QKV_REP_SHARDS = qkv_output_slices(2, 1, 3, WORLD)  # (6, 3, 3), k/v replicated

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

#: Awkward sizes on purpose: odd hidden sizes (column), rank 1, a single token, every
#: token on a different slot, no token with a LoRA, k/v heads fewer than ranks.
SPECS = [
    Spec("column-fp32", "column", (6,), 5, 3, 3, 7, "uniform", F32, True),
    Spec("column-gate_up-bf16-one-token", "column", (4, 6), 7, 1, 2, 1, "identical", BF16, True),
    Spec("column-qkv-gqa-fp16", "column", QKV_GQA, 6, 2, 4, 9, "distinct", F16, False),
    Spec(
        "column-qkv-kv-replicated", "column", QKV_REP, 5, 3, 3, 6, "zipf", F32, True, QKV_REP_SHARDS
    ),
    Spec("column-no-lora", "column", (4,), 3, 2, 2, 5, "none", F32, True),
    Spec("column_sharded-fp32", "column_sharded", (6,), 5, 4, 3, 7, "uniform", F32, True),
    Spec("column_sharded-gate_up-bf16", "column_sharded", (4, 6), 3, 2, 2, 5, "zipf", BF16, False),
    Spec(
        "column_sharded-qkv-kv-replicated",
        "column_sharded",
        QKV_REP,
        7,
        6,
        4,
        8,
        "distinct",
        F32,
        True,
        QKV_REP_SHARDS,
    ),
    Spec("row-fp32", "row", (5,), 6, 3, 3, 7, "uniform", F32, True),
    Spec("row-bf16-rank1-one-token", "row", (7,), 4, 1, 2, 1, "identical", BF16, False),
    Spec("row-fp16-no-lora", "row", (3,), 2, 2, 2, 4, "none", F16, True),
    Spec("row_sharded-fp32", "row_sharded", (6,), 4, 2, 3, 7, "zipf", F32, True),
    Spec("row_sharded-bf16", "row_sharded", (4,), 10, 5, 4, 9, "distinct", BF16, True),
    Spec("row_sharded-fp16", "row_sharded", (2,), 2, 3, 1, 3, "uniform", F16, False),
]
CASES = [spec.case(seed) for seed, spec in enumerate(SPECS)]

#: One run of every case per backend, shared by the tests; a failure is kept and
#: raised again in every test that needs the run, with the ranks' tracebacks.
_RUNS: dict[str, object] = {}


def outputs(backend: str, cases) -> list[list[torch.Tensor]]:
    if backend not in _RUNS:
        try:
            _RUNS[backend] = run_layer_cases(cases, WORLD, backend=backend, timeout=120)
        except Exception as error:  # kept, so each test fails with the ranks' tracebacks
            _RUNS[backend] = error
    run = _RUNS[backend]
    if isinstance(run, Exception):
        raise run
    return run


def check_case(spec: Spec, case: LayerCase, per_rank: list[torch.Tensor]) -> None:
    """Each rank's whole output equals the unsharded layer's, and the ranks agree exactly."""
    want = case.layer.reference(case.x, case.slots)  # [T, sum N] fp64
    # tolerance.py allows two roundings to the output dtype; widening the magnitude by
    # roundings/2 allows this layer's (each rounding errs by at most u_out * magnitude).
    magnitude = case.layer.reference(case.x, case.slots, absolute=True)
    magnitude = magnitude * max(1.0, spec.roundings / 2)
    terms = case.layer.hidden + case.layer.rank
    for rank, got in enumerate(per_rank):
        assert got.shape == want.shape and got.dtype == spec.dtype, (rank, got.shape, got.dtype)
        assert_close(got, want, magnitude, terms, f"tp={WORLD} {spec.kind} {spec.dtype} r{rank}")
    for rank in range(1, WORLD):
        assert torch.equal(per_rank[rank], per_rank[0]), f"rank {rank} differs from rank 0"


@pytest.mark.parametrize("index", range(len(SPECS)), ids=[s.name for s in SPECS])
def test_sharded_layer_matches_unsharded_gloo(index):
    per_rank = [outputs_of_rank[index] for outputs_of_rank in outputs("gloo", CASES)]
    check_case(SPECS[index], CASES[index], per_rank)


# -- the sharding itself, in one process -----------------------------------------------


def _layers(cls, full, **kw):
    wrapper = wrapper_for_slots([0], full.loras, DEVICE)
    return [cls.from_full(full, wrapper, rank, WORLD, **kw) for rank in range(WORLD)]


def test_column_shards_reassemble_the_full_weights():
    full = LoRALinear.random(QKV_REP, 5, 4, 3)
    for cls in (ColumnParallelLinearWithLoRA, ColumnParallelLinearWithShardedLoRA):
        ranks = _layers(cls, full, shards=QKV_REP_SHARDS)
        for s, n in enumerate(QKV_REP_SHARDS):
            holders = [ranks[j * (WORLD // n)] for j in range(n)]
            assert torch.equal(torch.cat([r.lora_b[s] for r in holders], -2), full.lora_b[s])
            assert torch.equal(torch.cat([r.lora_bias[s] for r in holders], -1), full.lora_bias[s])
        assert ranks[0].output_slices == (3, 3, 3) and ranks[1].output_slices == (3, 3, 3)
        assert torch.equal(ranks[0].lora_b[1], ranks[1].lora_b[1])  # k replicated
    plain = _layers(ColumnParallelLinearWithLoRA, full, shards=QKV_REP_SHARDS)
    assert all(torch.equal(r.lora_a[0], full.lora_a[0]) for r in plain)  # A replicated
    sharded = _layers(ColumnParallelLinearWithShardedLoRA, full, shards=QKV_REP_SHARDS)
    assert sharded[0].lora_a[2].shape == (3, 1, 2, 5)  # r/tp rows of A
    assert torch.equal(torch.cat([r.lora_a[2] for r in sharded], -2), full.lora_a[2])


def test_row_shards_reassemble_the_full_weights():
    full = LoRALinear.random((6,), 4, 3, 2)
    plain = _layers(RowParallelLinearWithLoRA, full)
    assert torch.equal(torch.cat([r.lora_a[0] for r in plain], -1), full.lora_a[0])
    assert torch.equal(torch.cat([r.weight for r in plain], 1), full.weight)
    assert all(torch.equal(r.lora_b[0], full.lora_b[0]) for r in plain)  # B whole
    assert plain[0].lora_bias is full.lora_bias and plain[1].lora_bias is None  # bias once
    sharded = _layers(RowParallelLinearWithShardedLoRA, full)
    assert torch.equal(torch.cat([r.lora_b[0] for r in sharded], -2), full.lora_b[0])
    assert torch.equal(torch.cat([r.lora_bias[0] for r in sharded], -1), full.lora_bias[0])
    assert sharded[1].output_slices == (3,)


def test_gather_restores_the_unsharded_column_order_on_four_ranks(monkeypatch):
    """With 4 ranks and 2 k/v heads each k/v shard is on 2 ranks: gather takes one of each."""
    import punica_numba.parallel as parallel

    slices, shards = qkv_output_slices(4, 2, 3, 4)  # (12, 6, 6), shards (4, 2, 2)
    full = LoRALinear.random(slices, 5, 2, 1, bias=False)
    wrapper = wrapper_for_slots([-1], 1, DEVICE)
    ranks = [
        ColumnParallelLinearWithLoRA.from_full(full, wrapper, k, 4, shards=shards) for k in range(4)
    ]
    # Gathering only moves columns, so W^T (one column per output feature) is output enough.
    local = [layer.weight.T for layer in ranks]  # [H, 3 + 3 + 3] per rank
    monkeypatch.setattr(parallel, "all_gather", lambda t, group=None: local)
    assert torch.equal(ranks[2].gather(local[2]), full.weight.T)  # [H, 12 + 6 + 6]


def test_shard_helpers_and_their_errors():
    t = torch.arange(12).reshape(2, 6)
    assert shard(t, 1, 1, 3).tolist() == [[2, 3], [8, 9]]
    assert [shard_index(k, 4, 2) for k in range(4)] == [0, 0, 1, 1]
    assert qkv_output_slices(8, 2, 4, 4) == ((32, 8, 8), (4, 2, 2))
    with pytest.raises(ValueError, match="does not split"):
        shard(t, 1, 0, 4)
    with pytest.raises(ValueError, match="outside"):
        shard(t, 1, 3, 3)
    with pytest.raises(ValueError, match="num_heads"):
        qkv_output_slices(3, 1, 2, 2)
    with pytest.raises(ValueError, match="one slice"):
        RowParallelLinearWithLoRA.from_full(
            LoRALinear.random((2, 2), 4, 2, 1), wrapper_for_slots([0], 1, DEVICE), 0, WORLD
        )


# -- the process harness ------------------------------------------------------------------


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    """Rank 1 raises; rank 0 waits for it in a collective that never completes."""
    if rank == 1:
        raise ValueError("rank one breaks on purpose")
    dist.barrier()


def test_a_failing_rank_fails_the_run_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as raised:
        run_on_ranks(_fail_on_rank_one, WORLD, backend="gloo", timeout=60)
    message = str(raised.value)
    assert "rank 1 of 2 failed" in message
    assert "ValueError: rank one breaks on purpose" in message
    assert "_fail_on_rank_one" in message  # the child's traceback, not just its message
    assert time.monotonic() - start < 40, "the waiting rank was not stopped"


# -- two GPUs ------------------------------------------------------------------------------

GPU_SPECS = [
    Spec("column-gate_up", "column", (1024, 1536), 1024, 16, 4, 77, "zipf", BF16, True),
    Spec(
        "column-qkv",
        "column",
        qkv_output_slices(16, 4, 64, WORLD)[0],
        1024,
        16,
        4,
        64,
        "uniform",
        BF16,
        True,
    ),
    Spec(
        "column_sharded-qkv",
        "column_sharded",
        (1024, 256, 256),
        1024,
        32,
        8,
        50,
        "distinct",
        BF16,
        True,
    ),
    Spec("row", "row", (1024,), 2048, 16, 4, 77, "uniform", BF16, True),
    Spec("row_sharded", "row_sharded", (1024,), 2048, 16, 4, 77, "zipf", F16, True),
]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sharded_layers_match_unsharded_nccl():
    cases = [spec.case(seed) for seed, spec in enumerate(GPU_SPECS)]
    results = outputs("nccl", cases)
    for index, spec in enumerate(GPU_SPECS):
        check_case(spec, cases[index], [per_rank[index] for per_rank in results])
