"""``HostStaging``: device buffers written through host twins and sent in one batch.

* a send copies every twin into its buffer, and nothing reaches a buffer before it;
* a buffer that is its own twin is written in place and never copied;
* pairs that do not fit (shape, dtype, a twin off the CPU, a strided tensor) and a
  tensor the staging does not hold are refused;
* on a GPU, where a copy reads its twin only when it runs, ``wait`` keeps the host from
  writing a twin again before its queued copy has run.
"""

from __future__ import annotations

import pytest
import torch

from punica_numba.staging import HostStaging, pinned_for, twin_of

from .strategies import DEVICE


def _buffers():
    return [
        torch.full((5,), -1, dtype=torch.int32, device=DEVICE),
        torch.zeros(2, 3, dtype=torch.int64, device=DEVICE),
    ]


def test_send_copies_every_twin_and_nothing_reaches_a_buffer_before():
    buffers = _buffers()
    staging = HostStaging([(b, twin_of(b)) for b in buffers])
    twins = [staging.host(b) for b in buffers]
    assert all(t.device.type == "cpu" and t is not b for t, b in zip(twins, buffers))
    assert twins[0].tolist() == [-1] * 5, "a twin starts as a copy of its buffer"
    assert twins[0].is_pinned() == pinned_for(buffers[0].device)
    twins[0].copy_(torch.arange(5))
    twins[1].fill_(7)
    assert buffers[0].tolist() == [-1] * 5 and not buffers[1].any(), "sent before send()"
    staging.send()
    staging.wait()
    assert buffers[0].tolist() == [0, 1, 2, 3, 4]
    assert buffers[1].tolist() == [[7] * 3] * 2


def test_a_buffer_that_is_its_own_twin_is_written_in_place():
    if DEVICE.type != "cpu":
        pytest.skip("a buffer is its own twin only on the CPU")
    buffer, other = _buffers()
    staging = HostStaging([(buffer, buffer), (other, twin_of(other))])
    assert staging.host(buffer) is buffer
    staging.host(buffer).fill_(3)
    assert buffer.tolist() == [3] * 5
    staging.send()
    assert buffer.tolist() == [3] * 5


@pytest.mark.parametrize("bad", ["shape", "dtype", "strided buffer", "twin on the GPU"])
def test_pairs_that_do_not_fit_are_refused(bad):
    buffer = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    twin = torch.zeros(4, 2, dtype=torch.int32)
    if bad == "shape":
        twin = torch.zeros(8, dtype=torch.int32)
    elif bad == "dtype":
        twin = twin.long()
    elif bad == "strided buffer":
        buffer = buffer.t()
        twin = twin.t().contiguous()
    elif DEVICE.type == "cpu":
        pytest.skip("no GPU for the twin")
    else:
        twin = twin.to(DEVICE)
    with pytest.raises(ValueError):
        HostStaging([(buffer, twin)])


def test_host_of_a_tensor_the_staging_does_not_hold_is_refused():
    buffer, other = _buffers()
    staging = HostStaging([(buffer, twin_of(buffer))])
    with pytest.raises(ValueError, match="not one of this staging's buffers"):
        staging.host(other)


@pytest.mark.gpu
def test_a_twin_is_not_rewritten_while_its_copy_is_queued():
    """A copy from page-locked memory reads the twin when the GPU runs it, not when it is
    queued. Queued behind a long kernel, the first send's copy has not run when the host
    wants to write the twin again: ``wait`` must hold the host until it has, so that the
    work queued between the two sends sees the first contents and the work after the
    second send the second."""
    buffer = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    staging = HostStaging([(buffer, twin_of(buffer))])
    assert staging.host(buffer).is_pinned()
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of the GPU's time
    staging.host(buffer).fill_(1)
    staging.send()  # queued behind the sleep
    between = buffer.clone()
    staging.wait()
    staging.host(buffer).fill_(2)
    staging.send()
    after = buffer.clone()
    torch.cuda.synchronize()
    assert bool((between == 1).all()), "the first copy read the twin's second contents"
    assert bool((after == 2).all())
