"""LeRobot's own pi0.5 (``lerobot==0.4.4``'s ``PI05Policy``), run as the oracle our LeRobot compatibility is tested
against. It runs in a venv of its own (``tests/oracles/README.md``), never in ours, and only LeRobot's, transformers'
and openpi's code computes what it writes: this file builds inputs, calls LeRobot's public entry points and records
what they return.

    python lerobot_pi05.py build OUT [--size=tiny|gemma_300m] [--seed=0]
        A random PI05Policy saved with LeRobot's ``save_pretrained`` (OUT/pretrained_model: config.json,
        model.safetensors, the pre/post-processor files), a tokenizer.json both sides use (PaliGemma's is not
        available offline), and OUT/oracle.safetensors + OUT/oracle.json: the inputs, LeRobot's normalized state,
        prompts and token ids, its action chunk for given initial noise (all cameras; one camera left out), and
        its loss for given noise and time (per element and reduced).
    python lerobot_pi05.py predict CHECKPOINT INPUTS OUT [--size=...]
        LeRobot's ``PI05Policy.from_pretrained`` and processors loaded from CHECKPOINT (one we wrote in LeRobot's
        format), the action chunk for the inputs and noise of INPUTS (an oracle.safetensors) -> OUT (safetensors).

Sizes (``lerobot_pi05_sizes.json``) change configuration values only: see its ``_doc``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SIZES = json.loads((HERE / "lerobot_pi05_sizes.json").read_text())
CAMERAS = ["observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb"]
STATE_DIM, ACTION_DIM, BATCH = 8, 7, 2
TASKS = ["pick_up the red block\n", "  put the bowl on the plate, then open the top drawer of the cabinet slowly  "]
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # the name LeRobot's processor asks for
EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"


def apply_size(size: str) -> None:
    """Configuration values of the models LeRobot builds for ``size`` (its classes and forward code untouched)."""
    import lerobot.policies.pi05.modeling_pi05 as m

    spec = SIZES[size]
    if spec["gemma"]:
        variants = {name: m.GemmaConfig(**dims) for name, dims in spec["gemma"].items()}
        m.get_gemma_config = lambda variant: variants[variant]
    real_paligemma, real_gemma = m.PaliGemmaForConditionalGeneration, m.GemmaForCausalLM

    def paligemma(config):
        for key, value in (spec["vision"] or {}).items():
            setattr(config.vision_config, key, value)
        # LeRobot 0.4.4 hard-codes gemma_2b's 2048; the projector must map to the language model's width
        config.vision_config.projection_dim = config.text_config.hidden_size
        if spec["vocab_size"]:
            config.text_config.vocab_size = spec["vocab_size"]
        return real_paligemma(config=config)

    def gemma(config):
        if spec["vocab_size"]:
            config.vocab_size = spec["vocab_size"]
        return real_gemma(config=config)

    m.PaliGemmaForConditionalGeneration = paligemma
    m.GemmaForCausalLM = gemma


def make_tokenizer(directory: Path):
    """A small byte-level BPE with PaliGemma's special tokens and its ``<bos>`` post-processor, saved as
    tokenizer.json, and the transformers tokenizer LeRobot's processor is handed in place of PaliGemma's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [f"Task: {t.strip()}, State: {' '.join(str(i) for i in range(j, j + 40))};\nAction: "
              for t in TASKS for j in range(0, 256, 40)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(directory / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token="<bos>",
                                   eos_token="<eos>", pad_token="<pad>")


def use_local_tokenizer(tokenizer) -> None:
    """LeRobot's processor loads PaliGemma's tokenizer from the Hub by name; hand it ours instead."""
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        return tokenizer if name == PALIGEMMA_TOKENIZER else real(name, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = from_pretrained


def random_stats(rng: np.random.Generator) -> dict[str, dict[str, torch.Tensor]]:
    stats = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        centre = rng.normal(0.0, 1.0, dim)
        spread = rng.uniform(0.5, 2.0, dim)
        values = {"mean": centre, "std": spread / 2, "min": centre - 1.5 * spread, "max": centre + 1.5 * spread,
                  "q01": centre - spread, "q10": centre - 0.6 * spread, "q50": centre,
                  "q90": centre + 0.6 * spread, "q99": centre + spread}
        stats[key] = {k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()}
    return stats


def randomize(policy: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn afresh (zero-initialised gates and norms included), scaled by its fan-in, so that no
    path of the network is trivially zero or one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            fan_in = p[0].numel() if p.dim() >= 2 else 1
            std = fan_in ** -0.5 if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)


def make_config(size: str):
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    spec = SIZES[size]
    s = spec["image_size"]
    return PI05Config(
        paligemma_variant=spec["paligemma_variant"], action_expert_variant=spec["action_expert_variant"],
        dtype="float32", device="cpu", chunk_size=spec["chunk_size"], n_action_steps=spec["chunk_size"],
        image_resolution=(s, s), tokenizer_max_length=spec["tokenizer_max_length"],
        input_features={**{k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, s, s)) for k in CAMERAS},
                        "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))},
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))},
    )


def make_inputs(config, seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed + 1)
    s = config.image_resolution[0]
    inputs = {f"input.{k}": torch.from_numpy(rng.integers(0, 256, (BATCH, 3, s, s), dtype=np.uint8)) for k in CAMERAS}
    state = rng.normal(0.0, 1.0, (BATCH, STATE_DIM)).astype(np.float32)
    state[0, 0] = -50.0  # far below q01: normalized below -1 (LeRobot writes bin -1)
    state[1, 1] = 50.0  # far above q99
    inputs["input.observation.state"] = torch.from_numpy(state)
    actions = rng.normal(0, 1, (BATCH, config.chunk_size, ACTION_DIM)).astype(np.float32)
    inputs["input.action"] = torch.from_numpy(actions)
    g = torch.Generator().manual_seed(seed + 2)
    inputs["input.noise"] = torch.randn((BATCH, config.chunk_size, config.max_action_dim), generator=g)
    inputs["input.loss_noise"] = torch.randn((BATCH, config.chunk_size, config.max_action_dim), generator=g)
    inputs["input.loss_time"] = torch.rand((BATCH,), generator=g) * 0.9 + 0.05
    return inputs


def observation(inputs: dict[str, torch.Tensor], cameras: list[str], with_action: bool) -> dict:
    """A LeRobot dataset-style batch: float images in [0, 1], the raw state, the task strings."""
    batch = {k: inputs[f"input.{k}"].float() / 255.0 for k in cameras}
    batch["observation.state"] = inputs["input.observation.state"].clone()
    if with_action:
        batch["action"] = inputs["input.action"].clone()
    batch["task"] = list(TASKS)
    return batch


def fixed_draws(policy, noise: torch.Tensor, time: torch.Tensor | None = None) -> None:
    """The model's noise (and time) draws replaced by given tensors: the comparison is then deterministic."""
    policy.model.sample_noise = lambda shape, device: noise.clone().to(device)
    if time is not None:
        policy.model.sample_time = lambda bsize, device: time.clone().to(device)


def run_policy(policy, preprocessor, postprocessor, inputs: dict[str, torch.Tensor], record: dict, meta: dict) -> None:
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep

    prompts: list[str] = []
    prepare = next(i for i, step in enumerate(preprocessor.steps)
                   if isinstance(step, Pi05PrepareStateTokenizerProcessorStep))

    def after(index, transition):
        if index == prepare:
            from lerobot.processor.core import TransitionKey
            prompts[:] = transition[TransitionKey.COMPLEMENTARY_DATA]["task"]
            record["lerobot.state_normalized"] = transition[TransitionKey.OBSERVATION]["observation.state"].clone()

    preprocessor.register_after_step_hook(after)
    policy.eval()
    with torch.no_grad():
        processed = preprocessor(observation(inputs, CAMERAS, with_action=False))
        meta["prompts"] = list(prompts)
        record["lerobot.tokens"] = processed["observation.language.tokens"].clone()
        record["lerobot.token_mask"] = processed["observation.language.attention_mask"].clone()
        fixed_draws(policy, inputs["input.noise"])
        chunk = policy.predict_action_chunk(processed)
        record["lerobot.actions_normalized"] = chunk.clone()
        record["lerobot.actions"] = postprocessor(chunk)
        # a camera slot of the checkpoint the observation does not have: LeRobot feeds an empty, masked image
        processed = preprocessor(observation(inputs, CAMERAS[:1], with_action=False))
        fixed_draws(policy, inputs["input.noise"])
        record["lerobot.actions_one_camera"] = postprocessor(policy.predict_action_chunk(processed))
        # the training loss for given noise and time
        processed = preprocessor(observation(inputs, CAMERAS, with_action=True))
        record["lerobot.action_normalized"] = processed["action"].clone()
        fixed_draws(policy, inputs["input.loss_noise"], inputs["input.loss_time"])
        images, image_masks = policy._preprocess_images(processed)
        per_element = policy.model.forward(images, image_masks, processed["observation.language.tokens"],
                                           processed["observation.language.attention_mask"],
                                           policy.prepare_action(processed))
        record["lerobot.loss_per_element"] = per_element[:, :, :ACTION_DIM].clone()
        loss, _ = policy.forward(processed)
        record["lerobot.loss"] = loss.detach().reshape(1)
    preprocessor.unregister_after_step_hook(after)


def build(out: Path, size: str, seed: int) -> None:
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
    from safetensors.torch import save_file

    apply_size(size)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "pretrained_model"
    checkpoint.mkdir(exist_ok=True)
    tokenizer = make_tokenizer(out)
    use_local_tokenizer(tokenizer)
    torch.manual_seed(seed)
    config = make_config(size)
    policy = PI05Policy(config)
    randomize(policy, seed)
    stats = random_stats(np.random.default_rng(seed))
    preprocessor, postprocessor = make_pi05_pre_post_processors(config, dataset_stats=stats)
    policy.save_pretrained(checkpoint)
    preprocessor.save_pretrained(checkpoint)
    postprocessor.save_pretrained(checkpoint)

    inputs = make_inputs(config, seed)
    record: dict[str, torch.Tensor] = dict(inputs)
    meta: dict = {"size": size, "seed": seed, "tasks": TASKS, "cameras": CAMERAS,
                  "versions": versions()}
    del policy  # what LeRobot reads back from its own file is the oracle (its strict load reports the tied
    policy = PI05Policy.from_pretrained(checkpoint, config=config)  # embedding as missing; the tie fills it)
    check_loaded_whole(policy, checkpoint)
    run_policy(policy, preprocessor, postprocessor, inputs, record, meta)
    save_file({k: v.contiguous() for k, v in record.items()}, str(out / "oracle.safetensors"))
    (out / "oracle.json").write_text(json.dumps(meta, indent=1) + "\n")


def predict(checkpoint: Path, inputs_path: Path, out: Path, size: str) -> None:
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
    from safetensors.torch import load_file, save_file

    apply_size(size)
    tokenizer_dir = inputs_path.parent
    from transformers import PreTrainedTokenizerFast

    use_local_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"),
                                                bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"))
    inputs = load_file(str(inputs_path))
    policy = PI05Policy.from_pretrained(checkpoint)
    check_loaded_whole(policy, checkpoint)
    preprocessor = PolicyProcessorPipeline.from_pretrained(checkpoint, config_filename="policy_preprocessor.json")
    postprocessor = PolicyProcessorPipeline.from_pretrained(
        checkpoint, config_filename="policy_postprocessor.json", to_transition=policy_action_to_transition,
        to_output=transition_to_policy_action)
    record: dict[str, torch.Tensor] = {}
    meta: dict = {}
    run_policy(policy, preprocessor, postprocessor, inputs, record, meta)
    save_file({k: v.contiguous() for k, v in record.items()}, str(out))
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")


def check_loaded_whole(policy, checkpoint: Path) -> None:
    """Every tensor of the file is what LeRobot's model holds after ``from_pretrained``, and it holds no other
    (its strict load reports the tied embedding as missing, for its own files too: the tie fills it). One tensor
    at a time, so that a full-size model is not held twice."""
    from safetensors import safe_open

    state = policy.state_dict()
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        differ = [k for k in names if k not in state or not torch.equal(state[k], f.get_tensor(k).to(state[k].dtype))]
        tied = LM_HEAD in names and torch.equal(state[EMBED], f.get_tensor(LM_HEAD).to(state[EMBED].dtype))
    missing = sorted(set(state) - names - {EMBED})
    if differ or missing or not tied:
        raise SystemExit(f"LeRobot did not load {checkpoint} whole: differ {sorted(differ)[:5]}, missing "
                         f"{missing[:5]}, embedding tied to lm_head: {tied}")


def versions() -> dict[str, str]:
    import lerobot
    import transformers

    return {"lerobot": lerobot.__version__, "transformers": transformers.__version__, "torch": torch.__version__}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    p = sub.add_parser("predict")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("inputs", type=Path)
    p.add_argument("out", type=Path)
    for s in (b, p):
        s.add_argument("--size", default="tiny", choices=sorted(k for k in SIZES if not k.startswith("_")))
        s.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers.models.siglip import check

    if not check.check_whether_transformers_replace_is_installed_correctly():
        raise SystemExit("this venv's transformers is not 4.53.2 with openpi's transformers_replace files "
                         "(tests/oracles/README.md)")
    if args.command == "build":
        build(args.out, args.size, args.seed)
    else:
        predict(args.checkpoint, args.inputs, args.out, args.size)


if __name__ == "__main__":
    main(sys.argv[1:])
