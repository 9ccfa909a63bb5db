"""The training engine: a ``Trainer`` that builds, parallelizes, runs and checkpoints a training run on one
process or on the data-parallel ranks torchrun or Ray Train started.

``Trainer(cfg, job).fit()`` goes build -> parallelize -> restore -> loop, and the loop calls its hooks (logging,
checkpointing, polling the evaluation that runs beside training: ``train/evaluation.py``) after every step. What
is trained on and how comes from the job (``train/components.py``: ``SupervisedJob`` in ``train/supervised.py``,
whose ``train(cfg)`` is `roboscale train`; ``RLJob`` in ``rl/job.py``): the policy is driven only through the Policy contract and the job's objective, the
data only through its ``DataSource`` (``next``, ``state_dict``), and the job's step hooks run after each applied
optimizer step; parallelism is applied to the plain policy from outside (``roboscale.distributed.parallelize``).

One optimizer step is one global batch (``--batch_size`` samples over all ranks). Each rank's share may be
split into micro-batches (a token budget, ``--grad_accum``); every rank runs the same number of them (a rank
with fewer repeats one at zero weight, since DDP and FSDP need the same forward/backward calls everywhere),
gradients are reduced once, with the last one, and each micro-batch's loss weight is normalized by the weight
summed over all ranks: the update is exactly the whole global batch's mean loss, whatever the number of ranks
or micro-batches; the objective's metrics are reduced by name in the same pass (``train/reduction.py``). Random
draws come from each sample's own seed (the loader's ``sample_seed``), so 1 and N ranks compute the same losses.

What a checkpoint restores besides the weights is the training state (the optimizer, RNG, and by name the
``Stateful`` entries: the trainer's step and schedule, the data's position, the job's own), saved and loaded as a
unit: a resumed run, at the same or another number of ranks, sees exactly the batches and draws the
uninterrupted run would have. Metrics stay tensors until they are logged.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roboscale.config import save_yaml
from roboscale.configs.train import OptimizerConfig, TrainerConfig
from roboscale.distributed.env import DistributedEnv, init_distributed
from roboscale.errors import ConfigError, TrainingError
from roboscale.train.components import (
    DataSource,
    Objective,
    Stateful,
    StepHook,
    TensorStateful,
    TrainingComponents,
    TrainingJob,
)
from roboscale.train.resume import resume_checkpoint, resuming
from roboscale.utils.io import exclusive_lock

if TYPE_CHECKING:
    from roboscale.distributed.mesh import ParallelPlan
    from roboscale.models.policy import Policy
    from roboscale.train.checkpoint import CheckpointWriter
    from roboscale.train.evaluation import EvaluationScheduler
    from roboscale.train.telemetry import Telemetry

log = logging.getLogger(__name__)

RESTARTED = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of restarts (``--max-restarts``): a restarted run resumes from its last checkpoint."""


class Trainer:
    def __init__(self, cfg: TrainerConfig, job: TrainingJob, *, progress: bool = True,
                 restartable: bool = False, eval_command: Callable[[Path, Path], list[str]] | None = None):
        """``cfg``: the Trainer's options (a ``TrainConfig`` or ``RLConfig``: what the job trains on is the job's).
        ``job``: the policy, data, objective, hooks and extra state (``train.supervised.SupervisedJob``,
        ``rl.job.RLJob``).
        ``eval_command``: (checkpoint, report directory) -> the argv that evaluates a checkpoint during
        training (default: ``roboscale eval`` with the ``--eval.*`` options)."""
        self.cfg = cfg
        self.job = job
        self.output_dir = Path(cfg.output_dir)
        self.progress = progress
        self.restartable = restartable or int(os.environ.get(RESTARTED, "0") or 0) > 0
        self.resume_from: Path | None = None
        self.env = DistributedEnv()
        self.plan: ParallelPlan | None = None
        self.step = 0
        self.policy: Policy | None = None  # the plain Policy (parallelize wraps it in self.module)
        self.module: torch.nn.Module | None = None
        self.components: TrainingComponents | None = None
        self.loader: DataSource | None = None  # the job's data (components.data; the name callers know)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.objective: Objective | None = None
        self.hooks: list[StepHook] = []
        """After every applied optimizer step: FP8's scales, the EMA update, then the job's hooks."""
        self.stateful: dict[str, Stateful] = {}
        """What checkpoints keep by name (``training_state/<name>_state.json``): ``trainer`` (this trainer's
        ``state_dict``), ``loader`` (the data), then the job's entries."""
        self.telemetry: Telemetry | None = None
        self.ema: dict[str, torch.Tensor] = {}
        self.skipped_steps = 0
        self._nonfinite_in_a_row = 0
        self._agreed_metrics: tuple[str, ...] | None = None  # the objective's metric names, as at the first step
        self.eval_command = eval_command
        self.evaluations: EvaluationScheduler | None = None  # rank 0's, with --eval.every
        self.checkpoints: CheckpointWriter | None = None

    def fit(self) -> Path:
        self.env = init_distributed(self.cfg.parallel.timeout_s, self.cfg.num_threads)
        try:
            return self._fit()
        finally:
            from roboscale.distributed.env import shutdown

            shutdown(self.env)

    def _fit(self) -> Path:
        from roboscale.distributed.mesh import resolve_plan

        cfg = self.cfg
        self.plan = resolve_plan(cfg.parallel, self.env)
        check_parallel_options(self.job.batch_size, cfg.grad_accum, self.plan)
        check_eval_options(cfg)
        if self.restartable and not cfg.resume and (self.output_dir / "checkpoints" / "last").exists():
            # a warning: a rank or worker failed and the launcher retried; the user should see it happened
            log.warning("restarted: resuming from the last checkpoint in %s", self.output_dir)
            cfg.resume = True
        self.resume_from = resume_checkpoint(self.output_dir) if cfg.resume else None
        if self.resume_from is None and (self.output_dir / "checkpoints").exists():
            raise ConfigError(f"--output_dir {self.output_dir} already has checkpoints; pass --resume=true to "
                              "continue it or choose another --output_dir")
        main = self.env.is_main
        # one run per output_dir: a second one (another shell, a retried job) would interleave checkpoints
        lock = exclusive_lock(self.output_dir / ".train.lock", lambda holder: ConfigError(
            f"--output_dir {self.output_dir}: another training ({holder}) is writing there"))
        with self._on_main(lambda: prepare_output_dir(self.output_dir)), (lock if main else contextlib.nullcontext()):
            if main:
                from roboscale.train.checkpoint import remove_stale_files

                for stale in remove_stale_files(self.output_dir):
                    log.info("removed %s, left by a run that was killed while saving", stale)
            self.build()
            self.parallelize()
            from roboscale.train.checkpoint import CheckpointWriter

            self.checkpoints = CheckpointWriter(self.output_dir, self.env, asynchronous=cfg.checkpoint.async_save,
                                                timeout_s=cfg.parallel.timeout_s)
            try:
                self.restore()
                return self.loop()
            except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (roboscale.utils.lifetime): say what is intact
                if getattr(exc, "explained", False):
                    raise
                raise self.interrupted(exc) from None
            finally:  # stop the loader's workers and the evaluation in flight even when a step fails (or Ctrl-C)
                if self.evaluations is not None:
                    self.evaluations.close()
                self.telemetry.close()
                self.loader.close()

    def interrupted(self, exc: KeyboardInterrupt) -> KeyboardInterrupt:
        from roboscale.train.checkpoint import last_checkpoint
        from roboscale.utils.lifetime import interrupted

        last = last_checkpoint(self.output_dir)
        kept = (f"the last checkpoint, {last.name}, is intact (continue with --resume=true)" if last is not None
                else "no checkpoint was saved")
        return interrupted(exc, f"at step {self.step}; {kept}")

    @contextlib.contextmanager
    def _on_main(self, action: Callable[[], None]):
        """Run ``action`` on rank 0; every rank raises if it failed there (the others would wait forever)."""
        error = None
        if self.env.is_main:
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
                error = exc
        if self.env.another_rank_failed(error is not None):
            raise TrainingError("rank 0 failed to prepare the run; its error is above")
        if error is not None:
            raise error
        yield

    # --- build ----------------------------------------------------------------------------------------------
    def build(self) -> None:
        """The job's policy, then its data, objective, hooks and state, in the order whose RNG draws make runs
        reproducible (the policy's initial weights follow the seed, the same on every rank)."""
        from roboscale.train.checkpoint import check_state_names
        from roboscale.train.telemetry import Telemetry

        cfg = self.cfg
        resumed = None
        self.seed()
        if self.resume_from is not None:  # its architecture and config; the weights come with the optimizer's
            from roboscale.models.policy import Policy

            with resuming(self.resume_from):
                resumed = Policy.from_pretrained(self.resume_from / "pretrained_model")
        self.policy = self.job.build_policy(self, resumed)
        self.components = components = self.job.build(self)
        self.objective = components.objective
        self.loader = components.data
        self.hooks = list(components.hooks)
        check_state_names(components.state)
        self.stateful = {"trainer": self, "loader": components.data, **components.state}
        self.telemetry = Telemetry(self.output_dir, self.job.batch_size, write=self.env.is_main,
                                   flops_per_sample=training_flops(self.policy) if components.counts_flops else None,
                                   peak=peak_flops(self.env.device, cfg.precision, cfg.fp8),
                                   ranks=self.env.world_size, wandb=cfg.wandb, config=cfg)

    def seed(self) -> None:
        """Seed torch's global RNG: the initial weights, the same on every rank. The objective's draws come from
        each sample's seed; what else draws from the global RNG (dropout) gets a stream per rank in ``loop``."""
        torch.manual_seed(self.cfg.seed)

    def parallelize(self) -> None:
        """Freeze what is asked, apply FP8 / activation checkpointing / compile / DDP or FSDP2 to the plain policy
        (``roboscale.distributed.parallelize``), then build the optimizer over what trains."""
        from roboscale.distributed.mesh import build_mesh
        from roboscale.distributed.parallelize import parallelize

        cfg = self.cfg
        own: list[StepHook] = []  # the trainer's step hooks, which run before the job's
        freeze(self.policy, cfg.freeze)
        if cfg.fp8:  # before sharding, as torchao's float8 all-gather wraps the converted weights
            from roboscale.train.fp8 import apply_fp8, fp8_after_optimizer_step

            converted = apply_fp8(self.policy, device=self.env.device, fsdp=self.plan.sharded)
            if self.env.is_main:
                log.info("fp8: %d Linear layers converted", len(converted))
            if self.plan.sharded:  # the next forward's scales of the FP8-gathered weights
                own.append(lambda _: fp8_after_optimizer_step(self.policy))
        self.module = parallelize(self.policy, self.objective, self.plan, build_mesh(self.plan, self.env),
                                  device=self.env.device, precision=cfg.precision,
                                  activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile)
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.optimizer.lr, betas=cfg.optimizer.betas,
                                           weight_decay=cfg.optimizer.weight_decay,
                                           **_optimizer_implementation(self.env.device))
        self.scheduler = make_scheduler(self.optimizer, cfg.optimizer, cfg.steps)
        if cfg.ema_decay:
            self.ema = {name: p.detach().clone() for name, p in self.policy.named_parameters() if p.requires_grad}
            own.append(lambda _: self.update_ema())
        self.hooks[:0] = own

    # --- state ----------------------------------------------------------------------------------------------
    def sharded_state(self) -> dict[str, Any]:
        """Weights and optimizer state as this rank holds them (FSDP: its shards), for DCP."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.policy, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        if self.ema:
            state["ema"] = self.ema
        return state

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own checkpointed state (``trainer_state.json``); the optimizer's is in the sharded part."""
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps,
                "world_size": self.env.world_size, "strategy": self.plan.strategy,
                "mesh": [self.plan.dp_replicate, self.plan.dp_shard]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def restore(self) -> None:
        """Continue from the checkpoint being resumed, if any; record the run's config beside its checkpoints."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from roboscale.train.checkpoint import load_training_state, restore_entries

        if self.resume_from is not None:
            with resuming(self.resume_from):
                sharded = self.sharded_state()
                saved, rng = load_training_state(self.resume_from, sharded, self.env, names=list(self.stateful))
                set_state_dict(self.policy, self.optimizer, model_state_dict=sharded["model"],
                               optim_state_dict=sharded["optimizer"])
                restore_entries(self.resume_from, self.stateful, saved)
            if rng is not None:
                torch.set_rng_state(rng)
            else:  # saved by fewer ranks: this rank's stream starts fresh (only dropout draws from it)
                torch.manual_seed(rank_seed(self.cfg.seed, self.env.rank, self.step))
            if self.env.is_main:
                log.info("resumed from %s at step %d (saved by %d ranks, now %d)", self.resume_from, self.step,
                         int(saved["trainer"].get("world_size", 1)), self.env.world_size)
        elif self.env.rank:  # rank 0 keeps the seed's own stream, so one process trains as it always did
            torch.manual_seed(rank_seed(self.cfg.seed, self.env.rank, 0))
        evaluated = self.start_evaluations()
        if self.resume_from is not None:
            self.telemetry.truncate_after(self.step, evaluated)
        if self.env.is_main:
            save_yaml(self.cfg, self.output_dir / "train_config.yaml")

    def start_evaluations(self) -> set[int] | None:
        """Rank 0, with --eval.every: the scheduler of evaluations during training, continuing the record of this
        output_dir's earlier evaluations from the resumed step; returns the evaluated steps (None: no scheduler)."""
        if not (self.env.is_main and self.cfg.eval.every):
            return None
        from roboscale.train.evaluation import EvaluationScheduler

        self.evaluations = EvaluationScheduler(self.output_dir, self.cfg.eval, command=self.eval_command,
                                               report=self.telemetry.write_eval)
        return self.evaluations.resume(self.step if self.resume_from is not None else 0)

    # --- the loop -------------------------------------------------------------------------------------------
    def micro_batches(self, batch: Any) -> list[Any]:
        """This rank's share of the global batch as the micro-batches it accumulates over."""
        if isinstance(batch, list):  # a token-budgeted collate already cut it
            return batch
        if self.cfg.grad_accum == 1:
            return [batch]
        if not isinstance(batch, dict):
            raise ConfigError(f"--grad_accum={self.cfg.grad_accum}: this policy's batches ({type(batch).__name__}) "
                              "are not split here; give the policy a token budget (pi0.5: --policy.pack_token_budget)")
        return split_batch(batch, self.cfg.grad_accum)

    def train_step(self, batch: Any) -> dict[str, torch.Tensor | float]:
        """One optimizer step over this rank's share of a global batch; metrics as tensors (global values): the
        objective's, reduced by name (``train/reduction.py``), and ``grad_norm``, ``lr``, ``skipped_steps``."""
        from roboscale.distributed.parallelize import set_gradient_sync
        from roboscale.train.reduction import StepMetrics, loss_weight, maxed_names, summed_names

        env, device = self.env, self.env.device
        self.optimizer.zero_grad(set_to_none=True)
        # over micro-batches, then ranks
        totals = StepMetrics(summed_names(self.objective), device, agreed=self._agreed_metrics,
                             maxed=maxed_names(self.objective))
        # bf16: FSDP gathers bf16 weights (half the traffic); autocast casts what the policy computes inside a
        # block (pixels, positions) to match them
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16")

        def accumulate(micro_batch: Any, sync: bool, counted: bool) -> None:
            with set_gradient_sync(self.module, sync), autocast:
                loss, metrics = self.module(micro_batch)
                weight = loss_weight(metrics).to(device=device, dtype=torch.float32)
                if not counted:  # a rank with fewer micro-batches keeps step with the others, at zero weight
                    weight = weight * 0
                (loss * weight).backward()
            if counted:
                totals.add({"loss": loss.detach(), **metrics}, weight)

        if isinstance(batch, Iterator):  # micro-batches that arrive over time (RL: as simulators finish episodes)
            micro = self.accumulate_stream(batch, accumulate)
        else:
            micro = [self.to_device(m) for m in self.micro_batches(batch)]
            count = len(micro)
            if env.distributed:
                count = int(all_reduce(torch.tensor([count], dtype=torch.float64), "max")[0])
            for i in range(count):  # gradients are reduced over ranks once, with the last
                accumulate(micro[min(i, len(micro) - 1)], sync=i == count - 1, counted=i < len(micro))
        reduced = totals.reduce(env.distributed)
        self._agreed_metrics = totals.names
        # reduced gradients are the mean over data-parallel ranks of sum_i w_i grad(loss_i): times ranks / total
        # weight gives the global batch's weighted mean
        scale = self.plan.dp_size / max(float(reduced["loss_weight"]), 1e-12)
        for p in self.policy.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        clip = self.cfg.optimizer.grad_clip_norm
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.policy.parameters() if p.requires_grad],
                                                   clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        loss_value = reduced["loss"]
        applied = bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(loss_value))
        if applied:
            self.optimizer.step()
            self._nonfinite_in_a_row = 0
        else:
            self.skipped_steps += 1
            self._nonfinite_in_a_row += 1
            episodes = batch_episodes(micro, env.distributed)
            log.warning("step %d: loss %s, gradient norm %s: the update was skipped (its batch: %s)",
                        self.step + 1, float(loss_value), float(grad_norm), episodes)
            if self._nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
                raise TrainingError(f"step {self.step + 1}: loss or gradient norm not finite in "
                                    f"{self._nonfinite_in_a_row} steps in a row (--max_nonfinite_steps), the last "
                                    f"one's batch: {episodes}; the last checkpoint is intact. Lower "
                                    "--optimizer.lr, check the data (roboscale data validate), or use fp32")
        self.scheduler.step()
        self.step += 1
        if applied:  # FP8's scales and the EMA first, then the job's (which may publish the new weights)
            for hook in self.hooks:
                hook(self)
        return {**reduced, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0],
                "skipped_steps": float(self.skipped_steps)}

    def accumulate_stream(self, stream: Iterator[Any], accumulate: Callable[[Any, bool, bool], None]) -> list[Any]:
        """Accumulate micro-batches as they arrive; returns them. How many there will be is not known in advance,
        so before each the ranks agree whether any has one left (a rank that has none repeats its last at zero
        weight), and each reduces its gradients (the last is not known when it runs). The wait for an arrival is
        the step's data wait."""
        received: list[Any] = []
        while True:
            with self.telemetry.blocked("data"):
                micro_batch = next(stream, None)
            more = micro_batch is not None
            if self.env.distributed:
                more = bool(all_reduce(torch.tensor([float(more)], dtype=torch.float64), "max")[0])
            if not more:
                return received
            if micro_batch is None and not received:
                raise TrainingError(f"step {self.step + 1}: rank {self.env.rank} received no micro-batch while "
                                    "other ranks did")
            if micro_batch is not None:
                received.append(self.to_device(micro_batch))
            accumulate(received[-1], True, micro_batch is not None)

    @torch.no_grad()
    def update_ema(self) -> None:
        """The averaged weights after an optimizer step (a step hook with --ema_decay)."""
        if not self.ema:
            return
        decay = self.cfg.ema_decay
        for name, p in self.policy.named_parameters():
            if name in self.ema:
                self.ema[name].lerp_(p.detach(), 1.0 - decay)

    def to_device(self, batch: Any) -> Any:
        """Batches move to this rank's device (CPU training: they are there)."""
        if self.env.device.type == "cpu":
            return batch
        if isinstance(batch, dict):
            return {k: v.to(self.env.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()}
        return batch.to(self.env.device, non_blocking=True) if hasattr(batch, "to") else batch

    def loop(self) -> Path:
        from tqdm import tqdm

        from roboscale.train.checkpoint import PRETRAINED, last_checkpoint

        self.module.train()
        final = None
        with tqdm(total=self.cfg.steps, initial=self.step, desc="training", unit="step",
                  disable=not (self.progress and self.env.is_main)) as bar:
            while self.step < self.cfg.steps:
                with self.telemetry.blocked("data"):
                    batch = next(self.loader)
                metrics = self.train_step(batch)
                self.log(metrics, bar)
                final = self.checkpoint() or final
                if self.evaluations is not None:
                    self.evaluations.poll()  # never waits: a finished evaluation is recorded, the queued one starts
        last_write = self.checkpoints.wait()  # the final checkpoint's background write
        if last_write is not None:
            self.committed(last_write)
            final = last_write
        if final is None:  # resumed at the last step: nothing left to train
            final = last_checkpoint(self.output_dir)
        if self.evaluations is not None:  # the final checkpoint's evaluation too, so that `best` is final
            self.evaluations.finish(int(final.name))
        return final / PRETRAINED

    # --- hooks ----------------------------------------------------------------------------------------------
    def log(self, metrics: dict[str, Any], bar: Any) -> None:
        cfg = self.cfg
        log_now = self.step % cfg.log_freq == 0 or self.step == cfg.steps
        summary = self.telemetry.step(self.step, metrics, log_now=log_now)
        bar.update(1)
        if summary is None:
            return
        if self.env.distributed:  # stragglers: the slowest rank's step time against the fastest's
            times = torch.tensor([summary["step_time"], -summary["step_time"]], dtype=torch.float64)
            slowest, fastest = all_reduce(times, "max").tolist()
            summary["step_time_spread"] = (slowest + fastest) / max(summary["step_time"], 1e-9)
        summary.update(memory_metrics(self.policy, self.optimizer, self.env.device))
        loader_stats = self.loader.stats()
        # batch diversity: distinct episodes in this rank's share of a batch (correlated batches cost success)
        summary["distinct_episodes"] = loader_stats.get("distinct_episodes", 0.0)
        self.telemetry.write(self.step, summary, loader_stats)
        shown = dict(loss=f"{summary['loss']:.4f}", smp_s=f"{summary['samples_per_s']:.0f}")
        if "mfu" in summary:
            shown["mfu"] = f"{100 * summary['mfu']:.1f}%"
        bar.set_postfix(**shown, wait=f"{100 * summary['data_wait']:.0f}%")

    def checkpoint(self) -> Path | None:
        """Save this step's checkpoint when one is due; returns the checkpoint committed during the call (with
        --checkpoint.async_save, an earlier step's whose background write has just finished), or None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        cfg = self.cfg
        committed = self.checkpoints.poll()
        if self.step % cfg.save_freq == 0 or self.step == cfg.steps or self.evaluation_due(self.step):
            with self.telemetry.blocked("checkpoint"):
                full = get_model_state_dict(self.policy,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if self.ema:  # the averaged weights are the ones worth evaluating
                    full.update({name: gather_full(value) for name, value in self.ema.items()})
                committed = self.checkpoints.save(
                    self.step, policy=self.policy, sharded_state=self.sharded_state(),
                    full_model_state=full if self.env.is_main else None,
                    training_state={name: entry.state_dict() for name, entry in self.stateful.items()},
                    tensor_state={name: entry.tensor_state() for name, entry in self.stateful.items()
                                  if isinstance(entry, TensorStateful)},
                    rng=torch.get_rng_state(), train_config=cfg) or committed
        if committed is not None:
            self.committed(committed)
        return committed

    def committed(self, step_dir: Path) -> None:
        """A checkpoint became ``last``: queue its evaluation if due, then apply retention (rank 0)."""
        from roboscale.train.checkpoint import prune_checkpoints

        if not self.env.is_main:
            return
        if self.evaluations is not None and self.evaluation_due(int(step_dir.name)):
            self.evaluations.submit(int(step_dir.name))
        keep = self.evaluations.pending() if self.evaluations is not None else []
        prune_checkpoints(self.output_dir, self.cfg.checkpoint.keep_last, keep=keep)

    def evaluation_due(self, step: int) -> bool:
        """--eval.every: the checkpoint of ``step`` is evaluated (every ``every`` steps, and the last one). A
        checkpoint is saved at these steps whatever --save_freq says, so ``every`` need not be a multiple of it."""
        every = self.cfg.eval.every
        return bool(every) and (step % every == 0 or step == self.cfg.steps)


def check_parallel_options(batch_size: int, grad_accum: int, plan: Any) -> None:
    """Options that cannot work with these ranks, named before anything is built (``batch_size``: the job's
    global batch)."""
    if batch_size % plan.dp_size:
        raise ConfigError(f"--batch_size={batch_size} is not divisible by the {plan.dp_size} data-parallel ranks "
                          f"(each rank takes an equal share of the global batch)")
    share = batch_size // plan.dp_size
    if grad_accum > share:
        raise ConfigError(f"--grad_accum={grad_accum} exceeds each rank's {share} samples of --batch_size="
                          f"{batch_size}")


def check_eval_options(cfg: TrainerConfig) -> None:
    """--eval.*: the environment and tasks of the evaluations during training, named before anything is built
    (each evaluation would otherwise fail and only be recorded, while training went on unevaluated)."""
    if not cfg.eval.every:
        return
    from roboscale.sim.env import env_spec

    try:
        spec = env_spec(cfg.eval.env)
    except ConfigError as exc:
        raise ConfigError(f"--eval.env: {exc}") from None
    try:
        spec.tasks_or_default(cfg.eval.tasks)
    except ConfigError as exc:
        raise ConfigError(f"--eval.tasks: {exc}") from None
    try:
        spec.parse_options(cfg.eval.env_options)
    except ConfigError as exc:  # its message names --env_options.NAME: here, --eval.env_options.NAME
        raise ConfigError(str(exc).replace("--env_options", "--eval.env_options")) from None


def freeze(policy: torch.nn.Module, components: list[str]) -> None:
    """No gradients (and so no optimizer state) for the named components: a component name of ``roboscale model
    info`` ("vision encoder (ViT)") or a module path ("vision", "vlm.layers")."""
    if not components:
        return
    named = list(policy.named_parameters())
    for component in components:
        chosen = [p for name, p in named
                  if policy.component_of(name) == component or name.startswith(component + ".")]
        if not chosen:
            known = sorted({policy.component_of(n) for n, _ in named} | {n.split(".")[0] for n, _ in named})
            raise ConfigError(f"--freeze: {policy.name} has no component {component!r} (components and modules: "
                              f"{', '.join(known)})")
        for p in chosen:
            p.requires_grad_(False)


def batch_episodes(batches: list[Any], distributed: bool, shown: int = 20) -> str:
    """'episodes 3, 7': the episodes of a step's samples, for a skipped step's messages: both policies' batches carry
    ``episode_index`` (a dict key for GR00T, a PackedBatch field for pi0.5). Gathered from every rank, which all
    skip the same step (its loss and gradient norm are global), so the collective cannot hang."""
    found: set[int] = set()
    for batch in batches:
        index = batch.get("episode_index") if isinstance(batch, dict) else getattr(batch, "episode_index", None)
        if isinstance(index, torch.Tensor):
            found.update(e for e in index.reshape(-1).tolist() if e >= 0)  # -1: a sample without one
    if distributed:
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, sorted(found))
        found = set().union(*parts)
    episodes = sorted(found)
    if not episodes:
        return "episodes unknown"
    more = f", … ({len(episodes)} in all)" if len(episodes) > shown else ""
    return f"episode{'s' if len(episodes) > 1 else ''} {', '.join(map(str, episodes[:shown]))}{more}"


def split_batch(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A dict batch cut into ``parts`` micro-batches along the sample dimension."""
    size = next(len(v) for v in batch.values() if isinstance(v, (torch.Tensor, list)))
    bounds = np.linspace(0, size, parts + 1).round().astype(int)
    return [{k: v[a:b] if isinstance(v, (torch.Tensor, list)) else v for k, v in batch.items()}
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return tensor


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor's full value on the CPU; plain tensors as they are."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu()


def rank_seed(seed: int, rank: int, step: int) -> int:
    """A rank's own RNG stream (dropout), distinct per rank and per resume point."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] >> 1)


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def memory_metrics(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
                   ) -> dict[str, float]:
    """``memory/state_bytes``: this rank's parameter + gradient + optimizer-state bytes (what sharding divides);
    allocated and peak device memory on a GPU, the process's peak resident memory on the CPU."""
    state = sum(_local_bytes(p) + _local_bytes(p.grad) for p in policy.parameters())
    state += sum(_local_bytes(v) for slots in optimizer.state.values() for v in slots.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    out = {"memory/state_bytes": float(state)}
    if device.type == "cuda":
        out["memory/allocated"] = float(torch.cuda.memory_allocated(device))
        out["memory/peak"] = float(torch.cuda.max_memory_allocated(device))
    else:
        import resource

        out["memory/peak"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


def training_flops(policy: Any) -> Any:
    """The policy's analytical training FLOPs per sample (``SampleFlops``, for MFU), with frozen components
    counted as such; None if its registry entry states none."""
    from roboscale.models.registry import get_spec

    function = get_spec(policy.name).flops_function()
    if function is None:
        return None
    flops = function(policy.config)
    frozen = {c.name for c in flops.components} - {
        policy.flops_component_of(name) for name, p in policy.named_parameters() if p.requires_grad}
    return flops.frozen(frozen) if frozen else flops


def peak_flops(device: torch.device, precision: str, fp8: bool) -> tuple[float, str]:
    """The device's peak rate for this precision and where the figure comes from (datasheet or measured)."""
    from roboscale.train.flops import peak_flops as peak

    return peak(device, "fp8" if fp8 else precision)


def prepare_output_dir(output_dir: Path) -> None:
    """Create ``output_dir`` and prove it writable now, not at the first checkpoint an hour later."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot write there ({exc.strerror or exc})") from None


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _optimizer_implementation(device: torch.device) -> dict[str, bool]:
    """AdamW's kernels: fused on CUDA; elsewhere foreach (a few multi-tensor ops per step). torch's CPU default is
    a Python loop over the parameters, a dozen ops each, which with FSDP2's DTensor parameters pays DTensor's
    dispatch on every one: a quarter of a 4-rank FSDP2 step of the demo policy on CPU (py-spy), where foreach
    pays it a dozen times per step."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}
