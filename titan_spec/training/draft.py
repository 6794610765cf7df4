"""The draft's side of a training step: its model, optimizer, schedule, metrics, state, export.

SpecTrainer owns one ``DraftTraining`` when ``[draft] enable = true``. Per step:

    loss(taps, logits, ...)   the draft kind's loss (EAGLE-3: TTT) from the policy forward's
                              detached taps and logits,
                              normalized by normalizer(): the trainable rows of the whole
                              step (all microbatches, all data-parallel ranks)
    step(k)                   the draft's own clipping, finiteness guard (titan_spec/training/finite.py:
                              a non-finite draft loss or gradient norm skips the AdamW step),
                              AdamW step
    scheduler.step()          its LR schedule, stepped with the policy's

The draft is small and is trained data-parallel with the policy: FSDP2 over the same
mesh, dp_shard x cp (sum-reduced; the loss is already normalized by the global count).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torchtitan.distributed.utils import clip_grad_norm_

from titan_spec import platform
from titan_spec.config import DraftConfig
from titan_spec.training.finite import StepGuard, fault, inject_nan_grad
from titan_spec.models.draft import DraftLossResult, draft_kind
from titan_spec.models.target import Taps

__all__ = ["DraftTraining", "initial_draft", "under_dump_folder"]


def initial_draft(
    cfg: DraftConfig, arch, token_counts_V: torch.Tensor | None, seed: int, target_dir: str | None = None
) -> torch.nn.Module:
    """The draft (of kind ``cfg.kind``) before training, unsharded: ``draft.init_from``, else a
    seeded random init (EAGLE-3: with the vocabulary mapping of the most frequent target
    tokens). ``target_dir``: the policy's HF checkpoint (a SpecForge DFlash directory takes
    the target's lm_head and mask row from it). Deterministic, so a resumed run rebuilds the same starting draft (the RL
    frozen-draft baseline uses it)."""
    kind = draft_kind(cfg.kind)
    draft = kind.initial(arch, token_counts_V, seed)
    if cfg.init_from:
        kind.load_into(draft, cfg.init_from, target_dir)
    return draft


class DraftTraining(Stateful):
    def __init__(
        self,
        cfg: DraftConfig,
        arch,
        *,
        device: torch.device,
        dp_mesh,
        lr_scheduler_cfg,
        training_steps: int,
        token_counts_V: torch.Tensor | None = None,
        seed: int = 0,
        start: torch.nn.Module | None = None,
        max_consecutive_skips: int = 3,
    ):
        """``start``: the draft before training (``initial_draft``), trained in place; None:
        built here from ``token_counts_V`` and ``seed``."""
        self.cfg = cfg
        self.kind = draft_kind(cfg.kind)
        draft = start if start is not None else initial_draft(cfg, arch, token_counts_V, seed)
        draft.to(device)
        self.dp_mesh = dp_mesh
        if dp_mesh is not None:
            fully_shard(draft, mesh=dp_mesh)
            draft.set_gradient_divide_factor(1.0)  # the loss is normalized by the global count
            platform.force_sum_reduction(draft)
        self.draft = draft
        self.optimizer = torch.optim.AdamW(
            draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True
        )
        self.scheduler = lr_scheduler_cfg.build(optimizers=[self.optimizer], training_steps=training_steps)
        self._acc: dict[str, torch.Tensor] = {}
        self.last_grad_norm = 0.0
        self.guard = StepGuard("draft", max_consecutive_skips)
        self._step_loss: torch.Tensor | None = None  # this step's draft loss (all microbatches)

    # --- per step ----------------------------------------------------------------------

    def normalizer(self, positions_BL: list[torch.Tensor], labels_BL: list[torch.Tensor], metas: list) -> torch.Tensor:
        """count_S: rows each loss step can train on, summed over the given microbatches and
        the data-parallel ranks. Like torchtitan's global_valid_tokens it is fixed before the
        forward (positions and labels only, not the target's argmax), so splitting a batch
        into pipeline microbatches leaves the loss and its gradients unchanged. Under context
        parallelism (a microbatch's meta is a CPMetadata) the draft kind counts the rank's
        shard with the rows it reads from other shards, and the sum runs over dp x cp."""
        return self._global_count(
            sum(
                self.kind.normalizer_counts(p, l, meta, self.cfg)
                for p, l, meta in zip(positions_BL, labels_BL, metas, strict=True)
            )
        )

    def _global_count(self, count_S: torch.Tensor) -> torch.Tensor:
        if self.dp_mesh is not None:
            dist.all_reduce(count_S, group=self.dp_mesh.get_group())
        return count_S

    def loss(
        self, logits_BLV: torch.Tensor, taps: Taps, positions_BL, labels_BL, meta, count_S=None
    ) -> DraftLossResult:
        """The draft kind's loss of one (micro)batch, normalized by ``count_S`` (default: this
        batch's ``normalizer``); ``meta`` may be a CPMetadata (the kind handles the shards)."""
        result = self.kind.loss(
            self.draft, logits_BLV, taps, positions_BL, labels_BL, meta, self.cfg, count_S, self._global_count
        )
        self._accumulate(result)
        loss = result.loss.detach()
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        return result

    def step(self, step: int = 0) -> bool:
        """Clip, then apply the AdamW step unless the step's draft loss or its (global)
        gradient norm is not finite. Returns whether the step was applied (the same on every
        rank of the draft's mesh). The LR schedule (``scheduler``) advances separately, with
        the policy's (training/joint_step.py): an RL step may take several optimizer steps
        on one schedule step."""
        params = [p for p in self.draft.parameters()]
        if fault("nan_grad_draft", step) and (self.dp_mesh is None or self.dp_mesh.get_local_rank() == 0):
            inject_nan_grad(params)
        # torchtitan's clip returns the pre-clip norm, all-reduced over the draft's mesh.
        norm = clip_grad_norm_(params, self.cfg.max_norm, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.last_grad_norm = float(norm)
        group = self.dp_mesh.get_group() if self.dp_mesh is not None else None
        ok = self.guard.check(self._step_loss, norm, group)
        self._step_loss = None
        if ok:
            self.optimizer.step()
        else:
            self.guard.log_skip(step)
            self.zero_grad()
        return ok

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._step_loss = None

    # --- metrics -----------------------------------------------------------------------

    def _accumulate(self, r: DraftLossResult) -> None:
        for name, value in (("loss_sum", r.loss_sum_S), ("count", r.count_S), ("correct", r.correct_S)):
            v = value.detach().to(torch.float64)
            self._acc[name] = self._acc[name] + v if name in self._acc else v

    def metrics(self) -> dict[str, float]:
        """Mean draft loss, accuracy and scored positions per loss (TTT) step since the last call (all ranks)."""
        if not self._acc:
            return {}
        stacked = torch.stack([self._acc["loss_sum"], self._acc["count"], self._acc["correct"]])
        if self.dp_mesh is not None:
            dist.all_reduce(stacked, group=self.dp_mesh.get_group())
        loss_sum, count, correct = stacked.cpu()
        self._acc = {}
        n = count.clamp(min=1)
        out = {
            "draft/grad_norm": self.last_grad_norm,
            "draft/lr": self.scheduler.schedulers[0].get_last_lr()[0],
            "draft/skipped_steps": self.guard.skipped,
        }
        out["draft/loss"] = float((loss_sum / n).mean())
        for j in range(len(count)):
            out[f"draft/acc_{j}"] = float(correct[j] / n[j])
            # Positions scored at step j: parity tests compare accuracies to one argmax flip
            # in this many (an exact count equality is bitwise; the argmax of logits computed
            # in another reduction order is not at a near-tie).
            out[f"draft/tokens_{j}"] = int(count[j])
        return out

    # --- state -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.draft),
            "optim": get_optimizer_state_dict(self.draft, self.optimizer),
            "lr": self.scheduler.state_dict(),
            "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.draft, sd["model"])
        set_optimizer_state_dict(self.draft, self.optimizer, sd["optim"])
        self.scheduler.load_state_dict(sd["lr"])
        self.guard.load_state_dict(sd["guard"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's full tensors by export name, on every rank (collective under FSDP)."""
        return get_model_state_dict(self.draft, options=StateDictOptions(full_state_dict=True))

    def export(self, path: str, write: bool) -> None:
        """Write the draft directory (EAGLE-3: SGLang-loadable; collective under FSDP).
        ``write``: this rank writes it; exactly one rank of the run may (the trainer picks
        the first rank of the last stage: under TP every tp rank holds a replica and is
        local rank 0 of its own data-parallel group, and two writers race on the rename)."""
        # Gathered on every rank (cpu_offload would keep it on global rank 0 only, which
        # under PP holds no draft); the draft is small.
        full = {k: v.cpu() for k, v in self.full_state_dict().items()}
        if not write:
            return
        copy = self.kind.build(self.draft.arch)
        copy.load_state_dict(full)
        self.kind.save(copy, path)


def under_dump_folder(dump_folder: str, export_dir: str) -> str:
    """An export path as configured: absolute, or relative to job.dump_folder."""
    return export_dir if os.path.isabs(export_dir) else os.path.join(dump_folder, export_dir)
