"""pi0.5 on PackedBatches: packed and padded layouts (and every CPU attention backend) compute the same thing."""

import pickle

import pytest
import torch

from roboscale.models.objective import flow_matching_loss

from roboscale.batching import PackedBatch
from roboscale.models.pi05.layout import PackCollate, collate
from tests.models.helpers import CAMERAS, batch, sample_dicts, tiny_policy


def _loss_and_grads(policy, packed_batch, seed=0):
    policy.zero_grad()
    torch.manual_seed(seed)  # same flow time and noise for both layouts (same samples, same order)
    loss, _ = flow_matching_loss(policy, packed_batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def _batches(policy, n=5, pad_language_to=16):
    transform, _ = policy.data_transforms()
    samples = [transform(s) for s in sample_dicts(n)]
    spec = policy.prefix_spec()
    padded_spec = type(spec)(**{**spec.__dict__, "pad_language_to": pad_language_to})
    return samples, collate(samples, spec, packed=True), collate(samples, padded_spec, packed=False)


def _assert_same(a, b):
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_and_padded_batches_give_the_same_loss_and_gradients():
    policy = tiny_policy(packing=True)
    _, packed, padded = _batches(policy)
    assert packed.packed and packed.rows == 1 and not padded.packed and padded.rows == 5
    # The packed stream holds only real tokens; the padded one also empty slots and language padding.
    assert packed.computed_tokens == packed.real_tokens < padded.computed_tokens
    _assert_same(_loss_and_grads(policy, packed), _loss_and_grads(policy, padded))


def test_token_budget_micro_batches_give_the_whole_batchs_loss_and_gradients():
    """Each sample draws its flow time and noise from its own seed (the loader's ``sample_seed``), so a split into
    micro-batches draws exactly what the whole batch draws; weighting each micro-batch's loss by its weight and
    dividing by the total gives the whole batch's loss and gradients (what the trainer does over micro-batches
    and ranks)."""
    policy = tiny_policy(packing=True)
    transform, _ = policy.data_transforms()
    samples = [transform({**s, "sample_seed": 1000 + i}) for i, s in enumerate(sample_dicts(6))]
    spec = policy.prefix_spec()
    whole = collate(samples, spec, packed=True)
    assert whole.sample_seed.tolist() == list(range(1000, 1006))
    budget = max(spec.sample_tokens(s) for s in samples) + 8
    micro = PackCollate(spec, packed=True, budget=budget)(samples)
    assert len(micro) >= 3 and all(m.real_tokens <= budget for m in micro)
    assert sorted(torch.cat([m.episode_index for m in micro]).tolist()) == sorted(whole.episode_index.tolist())
    loss, grads = _loss_and_grads(policy, whole)
    policy.zero_grad()
    total, weighted = 0.0, 0.0
    for part in micro:
        micro_loss, metrics = flow_matching_loss(policy, part)
        (micro_loss * metrics["loss_weight"]).backward()
        total, weighted = total + metrics["loss_weight"], weighted + micro_loss.detach() * metrics["loss_weight"]
    torch.testing.assert_close(weighted / total, loss, rtol=1e-5, atol=1e-7)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad / total, grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ["sdpa", "dense", "eager"])
def test_every_cpu_backend_matches_the_padded_reference(backend):
    policy = tiny_policy(packing=True)
    _, packed, padded = _batches(policy)
    policy.config.attention_backend = "dense"
    reference = _loss_and_grads(policy, padded)
    policy.config.attention_backend = backend
    _assert_same(_loss_and_grads(policy, packed), reference)


def test_empty_camera_slots_are_not_encoded_in_packed_mode():
    policy = tiny_policy(packing=True)
    samples, packed, padded = _batches(policy)
    real = sum(int(s.image_mask.sum()) for s in samples)
    assert real == 2 * len(samples) - 2  # two samples each lack one camera
    assert packed.images.shape[0] == real and padded.images.shape[0] == 2 * len(samples)
    seen = []
    policy.vision.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    flow_matching_loss(policy, packed)
    assert seen == [real]


def test_a_sample_in_a_pack_computes_what_it_computes_alone():
    policy = tiny_policy(packing=True).eval()
    samples, packed, _ = _batches(policy)
    spec = policy.prefix_spec()
    x = torch.randn(len(samples), policy.config.chunk_size, 4)
    t = torch.linspace(0.1, 0.9, len(samples))
    together = policy.velocity(policy.encode(packed, cache=True), x, t)
    for i in (0, 2, 4):  # (a sample lacking a camera cannot be collated alone: that camera would be absent)
        alone = collate([samples[i]], spec, packed=True)
        single = policy.velocity(policy.encode(alone, cache=True), x[i : i + 1], t[i : i + 1])
        torch.testing.assert_close(together[i : i + 1], single, rtol=1e-5, atol=1e-6)


def test_dict_batches_give_the_same_loss_packed_or_padded():
    obs = batch(b=3)
    losses = []
    for packing in (False, True):
        policy = tiny_policy(packing=packing)
        torch.manual_seed(3)
        losses.append(flow_matching_loss(policy, obs)[0].detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_inference_with_cached_prefix_is_the_same_packed_or_padded():
    obs = batch(b=3)
    actions = []
    for packing in (False, True):
        policy = tiny_policy(packing=packing).eval()
        torch.manual_seed(7)
        actions.append(policy.predict_action_chunk(obs))
    torch.testing.assert_close(actions[0], actions[1], rtol=1e-5, atol=1e-5)


def test_flex_inference_on_cpu_matches_sdpa_and_refuses_to_train():
    policy = tiny_policy(packing=True).eval()
    obs = batch(b=3)
    torch.manual_seed(7)
    reference = policy.predict_action_chunk(obs)
    policy.config.attention_backend = "flex"
    torch.manual_seed(7)
    torch.testing.assert_close(policy.predict_action_chunk(obs), reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="no backward on CPU"):
        flow_matching_loss(policy.train(), obs)


def test_data_transforms_are_picklable_and_give_the_same_batch():
    policy = tiny_policy(packing=True)
    transform, collate_fn = policy.data_transforms()
    transform2, collate_fn2 = pickle.loads(pickle.dumps((transform, collate_fn)))
    dicts = sample_dicts(3)
    a = collate_fn([transform(s) for s in dicts])
    b = collate_fn2([transform2(s) for s in dicts])
    assert isinstance(a, PackedBatch)
    for name in ("images", "tokens", "state", "actions", "prefix_index", "position_ids", "cu_seqlens"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    # The transform normalized state and actions with the policy's statistics.
    torch.testing.assert_close(a.state[0], policy.state_normalizer.normalize(dicts[0]["observation.state"]))


def test_a_camera_missing_from_the_whole_batch_is_an_error():
    policy = tiny_policy(packing=True)
    obs = batch(b=2)
    del obs[CAMERAS[1]]
    with pytest.raises(KeyError, match="observation.images.wrist.*policy.image_keys"):
        flow_matching_loss(policy, obs)
    transform, collate_fn = policy.data_transforms()
    dicts = sample_dicts(2, drop=((0, 1), (1, 1)))
    with pytest.raises(ValueError, match=r"camera slot\(s\) \[1\] are empty in every sample"):
        collate_fn([transform(s) for s in dicts])


def test_bad_backend_names_fail_with_the_choices():
    with pytest.raises(Exception, match="attention_backend.*not one of"):
        tiny_policy(attention_backend="flash3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash varlen and compiled flex need CUDA")
@pytest.mark.parametrize("backend", ["varlen", "flex", "auto"])
def test_gpu_packed_backends_match_padded_sdpa_in_bf16(backend):
    from roboscale.models.attention import varlen_available

    if backend == "varlen" and varlen_available() is None:
        pytest.skip("no varlen flash kernel in this torch")
    policy = tiny_policy(packing=True).cuda()
    _, packed, padded = _batches(policy)
    results = []
    for b, name in ((padded, "sdpa"), (packed, backend)):
        policy.config.attention_backend = name
        policy.zero_grad()
        torch.manual_seed(0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = flow_matching_loss(policy, b.to("cuda"))
        loss.backward()
        results.append((loss.detach().float(), policy.action_in_proj.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=5e-2, atol=5e-2)


@pytest.mark.slow
def test_gpu_suite_dry_run_prints_both_tables():
    """benchmarks/gpu_suite.py runs only where a GPU is; its CPU dry run keeps the script from rotting."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"
    out = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Training step (fwd + bwd)" in out.stdout and "prefix KV cache" in out.stdout
    assert "| ONNX Runtime CPUExecutionProvider |" in out.stdout
    assert "| packed + auto |" in out.stdout
