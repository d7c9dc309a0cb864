"""Kernel launches of one engine step at the released size, counted on the meta device
(tests/launch_count.py: ATen ops at their CUDA kernel counts, host copies and reads, Triton
launches; block sizes, grids and split counts as on an H200), per layer and outside the layers.

Each count is pinned as a ceiling (the counts of this commit): a change that adds a launch to the
step fails here, and says where. Before the fused layer (kernels/fused.py) and the device step
(engine/fused/step.py) a bf16 step took 3,452 launches at batch 1 (111-112 a layer, 97 outside)
and 3,778 at batch 8; fp8 5,632; int4 and nvfp4 4,892.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from launch_count import ENCODE_PINNED, PINNED, TURBO_PINNED, encode_launches, released_net, step_launches  # noqa: E402

LAYERS = 30
PER_LAYER, OUTSIDE = 20, 40  # the GPU issue's bound: 640 a step (and 20 a layer for an encode, issue 54)


@pytest.fixture(scope="module")
def bf16_net():
    return released_net(None)


def check(launches, key):
    per, outside, total = PINNED[key]
    print(
        f"\n{key}: {launches.summary()}\n  layer 0: {launches.detail('layer 0')}\n  outside: {launches.detail('outside')}"
    )
    layers = launches.layers
    assert len(layers) == LAYERS
    assert max(layers) <= per, f"a layer launches {max(layers)} kernels (pinned {per}): {launches.detail('layer 0')}"
    assert launches.outside <= outside, (
        f"{launches.outside} launches outside the layers (pinned {outside}): {launches.detail('outside')}"
    )
    assert launches.total <= total
    return launches


@pytest.mark.parametrize("batch", [1, 8])
def test_a_bf16_step_launches_a_few_kernels_a_layer(bf16_net, batch):
    launches = check(step_launches(bf16_net, batch), ("bf16", batch))
    assert max(launches.layers) <= PER_LAYER and launches.outside <= OUTSIDE and launches.total <= 640
    assert launches.eager <= 6  # the step's inputs (one copy up, three stacks) and its one read: the rest replays
    assert launches.kernels("outside")["d2h:tolist"] == 1  # the stop flags, whatever the batch


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8", "int4", "nvfp4"])
def test_quantised_steps_launch_what_bf16_does(bf16_net, scheme):
    """Quantised weights add no launch (every format is one GEMM kernel: kernels/triton_quant.py),
    but for fp8's W8A8 (issue 54, item 2): one per-token quantisation a layer (o_proj's input, the
    attention's output; launch_count.PINNED says why), 30 a step, and none in an AR token."""
    launches = check(step_launches(released_net(scheme), 1), (scheme, 1))
    assert launches.total <= PINNED[("bf16", 1)][2] + (30 if scheme == "fp8" else 0)
    assert launches.kernels("layer 0")["triton:_quantize_rows_kernel"] == (2 if scheme == "fp8" else 0)


def test_an_encode_pass_is_counted_and_pinned(bf16_net):
    """A committed block's encode on the fused path (prefill, commits, AR's prompt): at most 20
    launches a layer (issue 54), pinned at 13; nothing gathered or copied into the pool by torch."""
    launches = encode_launches(bf16_net)
    per, outside, total = ENCODE_PINNED
    print(
        f"\nencode: {launches.summary()}\n  layer 0: {launches.detail('layer 0')}\n  outside: {launches.detail('outside')}"
    )
    assert len(launches.layers) == LAYERS and max(launches.layers) <= min(per, PER_LAYER)
    assert launches.outside <= outside and launches.total <= total and launches.captured == 0
    layer = launches.kernels("layer 0")
    assert layer["triton:_paged_prefix_kernel"] == 1 and layer["triton:_qkv_kernel"] == 1
    assert not {"index_copy_", "index_select", "bmm", "_safe_softmax"} & set(layer), launches.detail("layer 0")


def test_the_counter_sees_every_kind_of_launch():
    """What the counter counts and what it does not: views and allocations nothing; a multi-kernel
    op its kernels; a host read one; a Triton launch one."""
    import torch

    from dgemma.kernels import triton_layer
    from launch_count import count_launches

    x = torch.empty(8, 4, device="meta")
    with count_launches() as launches:
        y = x.view(32).reshape(4, 8).t()  # views
        torch.empty(3, device="meta")  # an allocation
        (y + 1).sum()  # two kernels
        torch.sort(torch.empty(100, device="meta"))  # a small sort: copy, fill, bitonic sort
        triton_layer.gelu_mul(torch.empty(4, 8, device="meta"))  # a Triton launch (stubbed)
    assert launches.total == 2 + 3 + 1, launches.detail("outside")
    assert launches.kernels("outside")["triton:_gelu_mul_kernel"] == 1


@pytest.mark.parametrize("batch", [1, 8])
def test_a_turbo_pass_launches_about_a_default_passs_kernels(bf16_net, batch):
    """A turbo pass on the device path, captured like the default step: the plan, the fused
    layers over the computed rows (their keys and values written into the canvas K/V slots by the
    q|k|v kernel: no copies), the statistics, sampling and the decisions. At batch 1 at most a
    default pass + 20 (448 against 439: its router splits K over the pass's few rows, +1 a layer);
    at batch 8 one launch a layer more than a default pass (the attention splits the prefix of its
    fewer query rows) and 9 outside."""
    launches = step_launches(bf16_net, batch, turbo=True)
    per, outside, total = TURBO_PINNED[batch]
    print(f"\nturbo batch {batch}: {launches.summary()}\n  outside: {launches.detail('outside')}")
    assert max(launches.layers) <= per and launches.outside <= outside and launches.total <= total
    assert "triton:_turbo_plan_kernel" in launches.detail("outside")  # the device pass, not the eager step
    if batch == 1:
        assert launches.total <= PINNED[("bf16", 1)][2] + 20
