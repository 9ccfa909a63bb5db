"""Every attention backend against the materialised-mask reference (GPU backends skip without CUDA)."""

import pytest
import torch

from roboscale.models import attention
from roboscale.models.attention import flex_block_mask, pick_backend, varlen_attention

CUDA = torch.cuda.is_available()


def _segments(lq, lk, h=4, hkv=2, d=16, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, generator=g)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g)
    move = lambda t: t.to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    return move(q), move(k), move(v), cu_q, cu_k, max(lq), max(lk)


# Prefix-style (lq == lk) and suffix-style (50-like queries over prefix + suffix keys) layouts, ragged.
LAYOUTS = {"self": ([7, 1, 13, 4], [7, 1, 13, 4]), "suffix": ([3, 3, 3], [9, 4, 14])}


def _run(backend, q, k, v, cu_q, cu_k, mq, mk, causal=False):
    return varlen_attention(q, k, v, cu_q, cu_k, mq, mk, causal=causal, backend=backend)


def _grads(out, *inputs):
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(out.shape, generator=g).to(out)
    return torch.autograd.grad((out * weights).sum(), inputs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("backend", ["sdpa", "eager", "auto"])
def test_cpu_training_backends_match_the_dense_reference(backend, layout, causal):
    args = _segments(*LAYOUTS[layout])
    q, k, v = args[:3]
    reference = _run("dense", *args, causal=causal)
    out = _run(backend, *args, causal=causal)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for got, want in zip(_grads(out, q, k, v), _grads(reference, q, k, v), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flex_inference_on_cpu_matches_the_dense_reference(layout, causal):
    args = _segments(*LAYOUTS[layout])
    with torch.no_grad():
        torch.testing.assert_close(
            _run("flex", *args, causal=causal), _run("dense", *args, causal=causal), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("causal", [False, True])
def test_flex_tiles_match_the_mask_over_many_blocks(causal):
    """Segments longer than a 128-token tile (full tiles), ragged tails, an empty segment: the tile lists built
    from the boundaries cover every tile the element mask needs, and the output equals the reference."""
    from torch.nn.attention.flex_attention import create_block_mask

    lq, lk = [300, 5, 0, 140, 90], [300, 60, 0, 200, 91]
    args = _segments(lq, lk, h=2, hkv=1)
    cu_q, cu_k = args[3], args[4]
    tiles = flex_block_mask(cu_q, cu_k, causal, torch.device("cpu"))
    dense = attention.segment_mask(cu_q, cu_k, causal, "cpu")
    reference = create_block_mask(lambda b, h, q, k: dense[q, k], None, None, dense.shape[0], dense.shape[1], "cpu")
    ours, needed = tiles.to_dense().bool(), reference.to_dense().bool()
    assert bool((ours | ~needed).all())  # every needed tile is visited
    if not causal:
        assert torch.equal(ours, needed)  # and no others
    assert int(tiles.full_kv_num_blocks.sum()) > 0 or causal  # long segments give full tiles (no mask function)
    with torch.no_grad():
        torch.testing.assert_close(_run("flex", *args, causal=causal), _run("dense", *args, causal=causal),
                                   rtol=1e-5, atol=1e-5)


def test_flex_refuses_cpu_training_with_a_way_out():
    with pytest.raises(NotImplementedError, match="attention_backend=sdpa"):
        _run("flex", *_segments(*LAYOUTS["self"]))


def test_flex_block_masks_are_cached_per_layout():
    _, _, _, cu_q, cu_k, _, _ = _segments(*LAYOUTS["suffix"])
    first = flex_block_mask(cu_q, cu_k, False, torch.device("cpu"))
    assert flex_block_mask(cu_q.clone(), cu_k.clone(), False, torch.device("cpu")) is first
    assert flex_block_mask(cu_q, cu_k, True, torch.device("cpu")) is not first


def test_only_the_reference_backends_build_a_full_mask(monkeypatch):
    args = _segments(*LAYOUTS["self"])

    def no_dense_mask(*a, **kw):
        raise AssertionError("an [L, L] mask was materialised")

    monkeypatch.setattr(attention, "segment_mask", no_dense_mask)
    _run("sdpa", *args)
    with torch.no_grad():
        _run("flex", *args)
    with pytest.raises(AssertionError, match="materialised"):
        _run("dense", *args)


def test_segments_do_not_see_each_other():
    q, k, v, cu_q, cu_k, mq, mk = _segments(*LAYOUTS["suffix"])
    out = _run("sdpa", q, k, v, cu_q, cu_k, mq, mk).detach()
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[int(cu_k[1]) :] += 50.0  # change every key and value outside the first segment
    v2[int(cu_k[1]) :] -= 50.0
    out2 = _run("sdpa", q, k2, v2, cu_q, cu_k, mq, mk).detach()
    first = slice(0, int(cu_q[1]))
    torch.testing.assert_close(out[first], out2[first])
    assert not torch.allclose(out[int(cu_q[1]) :], out2[int(cu_q[1]) :])


def test_auto_picks_per_device_dtype_and_availability(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_backend(cpu, torch.float32, needs_grad=True) == "sdpa"
    assert pick_backend(cpu, torch.bfloat16, needs_grad=False) == "sdpa"
    monkeypatch.setattr(attention, "varlen_available", lambda: "torch")
    monkeypatch.setattr(attention, "flex_available", lambda: True)
    assert pick_backend(cuda, torch.bfloat16, needs_grad=True) == "varlen"
    assert pick_backend(cuda, torch.float32, needs_grad=True) == "flex"  # flash kernels are fp16/bf16 only
    assert pick_backend(cuda, torch.bfloat16, needs_grad=True, head_dim=512) == "flex"
    monkeypatch.setattr(attention, "varlen_available", lambda: None)
    assert pick_backend(cuda, torch.bfloat16, needs_grad=True) == "flex"


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="not one of"):
        _run("flash3", *_segments(*LAYOUTS["self"]))


def test_varlen_without_cuda_says_what_to_use_instead():
    if CUDA:
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="attention_backend=auto"):
        _run("varlen", *_segments(*LAYOUTS["self"]))


@pytest.mark.skipif(not CUDA, reason="flash varlen and compiled flex need CUDA")
@pytest.mark.parametrize("backend", ["varlen", "flex"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpu_backends_match_the_reference_in_bf16(backend, layout):
    if backend == "varlen" and attention.varlen_available() is None:
        pytest.skip("no varlen flash kernel in this torch")
    args = _segments(*LAYOUTS[layout], d=64, device="cuda", dtype=torch.bfloat16)
    q, k, v = args[:3]
    ref_args = tuple(t.detach().float().requires_grad_() for t in (q, k, v)) + args[3:]
    reference = _run("dense", *ref_args)
    out = _run(backend, *args)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
    for got, want in zip(_grads(out, q, k, v), _grads(reference, *ref_args[:3]), strict=True):
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)
