"""rl.behaviour_logprobs = "recompute": the trainer's own log-probs as the PPO ratio's denominator.

Before the step's first update, one no-grad forward of the policy per minibatch, at the
step's starting weights and sharded exactly as the update is (``RLTrainer.on_device``; under
pipeline parallelism the schedule's forward alone over the same microbatches), gives the
trainer's log-probs of the label tokens. They replace the engine's in the minibatch's
``values_BL["behaviour_logp"]``; with rl.tis each token also gets its truncated importance
weight ``values_BL["tis_weight"]`` from the engine's and the trainer's (rl/mismatch.py).
The engine/trainer mismatch of this rank's tokens is returned as sums (rl/logp_mismatch_*).
``trainer`` is the step's RLTrainer (rl/step.py; not imported: step.py calls this module).
"""

from __future__ import annotations

import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_spec.parallelisms.cp_batch import unshard_values
from titan_spec.parallelisms.pipeline import pipeline_forward_backward
from titan_spec.rl.logprobs import token_logprobs
from titan_spec.rl.mismatch import MismatchSums, tis_weights
from titan_spec.rl.step_records import Minibatch

__all__ = ["recompute_behaviour", "trainer_logprobs"]


def recompute_behaviour(trainer, minibatches: list[Minibatch]) -> dict[str, float]:
    """The trainer's log-probs of every minibatch replace the engine's (and, with rl.tis,
    set each token's truncated importance weight). Returns this rank's sums of the
    engine/trainer mismatch over its shards' tokens."""
    rl, total = trainer.rl, MismatchSums()
    for mb in minibatches:
        trainer_logp_BL, sums = trainer_logprobs(trainer, mb)
        total = total + sums
        values = mb.values_BL
        if rl.tis != "off":
            values["tis_weight"] = tis_weights(
                trainer_logp_BL,
                values["behaviour_logp"],
                values["seq_index"],
                mb.labels_BL != IGNORE_INDEX,
                rl.tis,
                rl.tis_cap,
            )
        values["behaviour_logp"] = trainer_logp_BL
    return total.as_dict()


def trainer_logprobs(trainer, mb: Minibatch) -> tuple[torch.Tensor, MismatchSums]:
    """The policy's log-probs of the minibatch's labels (one no-grad forward; under CP of
    this rank's shard, gathered back to the whole [B, L]) and the mismatch sums of this
    rank's shard against the engine's."""
    if trainer.parallel_dims.pp_enabled:
        return _pipelined_logprobs(trainer, mb)
    engine_BL = mb.values_BL["behaviour_logp"]
    inputs, labels, extra = trainer.on_device(mb)
    with trainer.train_context(), torch.no_grad():
        out = trainer.model_parts[0](inputs, **extra)
        logits = out[0] if isinstance(out, tuple) else out
        logp = token_logprobs(logits, labels, trainer.rl.temperature)
    engine = trainer.token_values(mb)["behaviour_logp"]
    sums = MismatchSums.of(logp, engine, labels != IGNORE_INDEX, trainer.rl)
    if trainer.parallel_dims.cp_enabled:
        logp = unshard_values(logp, mb.inputs["positions"].to(trainer.device), trainer.parallel_dims.get_mesh("cp"))
    return logp.to(engine_BL.device, engine_BL.dtype).view_as(engine_BL), sums


def _pipelined_logprobs(trainer, mb: Minibatch) -> tuple[torch.Tensor, MismatchSums]:
    """``trainer_logprobs`` under pipeline parallelism: the schedule's forward alone over the
    minibatch's microbatches (parallelisms/pipeline.py, forward_only), each microbatch's
    log-probs recorded on the last stage. The other stages keep the engine's (they
    compute no loss) and count no tokens."""
    engine_BL = mb.values_BL["behaviour_logp"]
    parts = trainer.microbatch_rows(mb)
    prepared = [trainer.on_device(mb, p) for p in parts]
    recorders = [_LogprobRecorder(trainer.rl.temperature) for _ in parts]
    run = trainer.pipeline_run()
    pipeline_forward_backward(run, prepared, None, recorders, forward_only=True)
    if not run.has_last_stage:
        return engine_BL, MismatchSums()
    pd, sums, logp_parts = trainer.parallel_dims, MismatchSums(), []
    for p, (_, labels, _), rec in zip(parts, prepared, recorders):
        engine = trainer.token_values(mb, p)["behaviour_logp"]
        sums = sums + MismatchSums.of(rec.logp, engine, labels != IGNORE_INDEX, trainer.rl)
        logp = rec.logp
        if pd.cp_enabled:
            logp = unshard_values(logp, mb.inputs["positions"][p].to(trainer.device), pd.get_mesh("cp"))
        logp_parts.append(logp.reshape(mb.labels_BL[p].shape))
    return torch.cat(logp_parts).to(engine_BL.device, engine_BL.dtype), sums


class _LogprobRecorder:
    """A policy loss (``co_training.PolicyLoss``) that only keeps its microbatch's log-probs:
    the pipelined recompute's, on the last stage."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.logp: torch.Tensor | None = None

    def __call__(self, logits_BLV, labels_BL, global_valid_tokens):
        self.logp = token_logprobs(logits_BLV, labels_BL, self.temperature)
        return self.logp.sum() * 0.0, None
