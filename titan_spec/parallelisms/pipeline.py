"""Pipeline parallelism for co-training: the target split over PP stages, the draft on the last.

``TapPipeline`` (``pipeline_spec``) is titan_spec's ``ModelSpec.pipelining_fn``: torchtitan's helpers, plus
static stage metadata (no shape-inference forward firing the tap hooks), ``TapStage`` (its tap
hook hands the stage's taps to the ``TapChannel``, tagged with the microbatch, outside every
compiled or checkpointed block) and ``PipelineLoss`` on the last stage (per microbatch: policy
loss + lambda * the draft's loss on that microbatch's taps). ``pipeline_forward_backward``
replaces torchtitan's ``pp_forward_backward_step`` so each microbatch carries its labels,
positions, document metadata and, in RL, its own PPO loss; the schedule is torch's, unchanged.
``gather_over_stages`` / ``broadcast_from_last_stage``: the RL push's exchange over the pp group.

Invariant: a pp run's losses and gradients are the one-stage run's (tests/test_pipeline.py).
Under pp x cp each stage runs its CP rank's zigzag share (docs/ARCHITECTURE.md, the SFT step).
"""

from __future__ import annotations

import types
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.pipeline_parallel import (
    _build_get_mesh_callback,
    _build_pipeline_schedule,
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
    _get_pp_rank_to_stage_indices_mapping,
    _split_module,
)

from titan_spec.models.target import EMBEDS_TAP, Taps
from titan_spec.parallelisms.tap_channel import TapChannel, TapLayout

__all__ = [
    "SCHEDULES",
    "Microbatch",
    "PipelineLoss",
    "TapStage",
    "pipeline_spec",
    "TapPipeline",
    "pipeline_forward_backward",
    "stage_module_names",
    "check_pipeline_split",
    "gather_over_stages",
    "broadcast_from_last_stage",
]

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""Schedules co-training runs and is tested with (full backward per microbatch, so the
draft's gradients accumulate in the same backward as the policy's)."""

TAP_TIMEOUT_S = 600.0
"""How long the last stage waits for a microbatch's taps before it raises (the pipeline's
own P2P waits as long; the first step may include compilation)."""


class Microbatch(NamedTuple):
    """The schedule's per-microbatch "target" on the last stage: all its loss needs."""

    index: int
    labels_BL: torch.Tensor
    positions_BL: torch.Tensor | None
    attention_masks: Any
    draft_count_S: torch.Tensor | None
    """The draft loss's normalizer over the whole step (DraftTraining.normalizer)."""
    policy_loss: Any = None
    """This microbatch's own policy loss (a co_training.PolicyLoss: RL's PPO-clip carries the
    microbatch's behaviour log-probs and advantages); None = the schedule's loss_fn."""
    co_loss: Any = None
    """The trainer's co-training loss (co_training.CoTrainingLoss) when a draft trains on this
    stage; None = the policy's loss alone."""


# ---------------------------------------------------------------------------
# The split, and the checks that need only the config
# ---------------------------------------------------------------------------


def stage_module_names(parallelism, n_layers: int, model_config) -> list[list[str]]:
    """Module names of each virtual stage: the configured split, else torchtitan's."""
    n_stages, _, input_weight, output_weight = _get_pipeline_metadata(
        types.SimpleNamespace(pp=parallelism.pipeline_parallel_degree), parallelism, model_config
    )
    if parallelism.module_fqns_per_model_part is not None:
        return [list(names) for names in parallelism.module_fqns_per_model_part]
    return _generate_llm_fqn_per_model_part(n_stages, n_layers, input_weight, output_weight)


def check_pipeline_split(names: list[list[str]], tap_ids: tuple[int, ...], draft: bool) -> None:
    """Raise ValueError (one line) for a split the co-training cannot run."""
    if "tok_embeddings" not in names[0]:
        raise ValueError(f"the first pipeline stage must hold tok_embeddings; it holds {names[0]}")
    if draft and not {"norm", "lm_head"} <= set(names[-1]):
        raise ValueError(
            "the draft trains on the last pipeline stage, next to the logits it learns from, so that stage "
            f"must hold norm and lm_head; it holds {names[-1]}"
        )
    seen: dict[str, int] = {}
    for s, stage in enumerate(names):
        for n in stage:
            if n in seen:
                # Two copies of one module: a tap layer among them would tap twice and the
                # TapChannel would deliver whichever arrived last.
                raise ValueError(
                    f"{n} is on pipeline stages {seen[n]} and {s}; every module must be on exactly one stage"
                )
            seen[n] = s
    held = set(seen)
    lost = [k for k in tap_ids if f"layers.{k}" not in held]
    if lost:
        raise ValueError(
            f"tap layer ids {lost} name no layer on any pipeline stage (the stages hold "
            f"{sorted(n for n in held if n.startswith('layers.'))})"
        )


def tap_layout(
    names: list[list[str]],
    tap_ids: tuple[int, ...],
    pp: int,
    schedule: str,
    shape_BLD: tuple[int, int, int],
    dtype: torch.dtype,
) -> TapLayout:
    stage_rank = {s: r for r in range(pp) for s in _get_pp_rank_to_stage_indices_mapping(r, pp, schedule, len(names))}
    stage_keys = {}
    for s, stage in enumerate(names):
        keys = ([EMBEDS_TAP] if "tok_embeddings" in stage else []) + [k for k in tap_ids if f"layers.{k}" in stage]
        if keys:
            stage_keys[s] = tuple(sorted(keys))
    return TapLayout(stage_keys, stage_rank, len(names) - 1, shape_BLD, dtype)


# ---------------------------------------------------------------------------
# Stages and the last stage's loss
# ---------------------------------------------------------------------------


class TapStage(PipelineStage):
    """A PipelineStage whose tap hook hands each microbatch's taps to the TapChannel."""

    def __init__(self, *args, channel: TapChannel | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel = channel

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        taps = getattr(self.submod, "stashed_taps", None)
        self.submod.stashed_taps = None
        # A stage without tap layers has nothing to hand over (the channel's end_step still
        # checks that every stage that should have tapped did, once per microbatch).
        if self.channel is not None and taps:
            self.channel.put(self.stage_index, fwd_chunk_id, taps)
        return out


class PipelineLoss:
    """The last stage's loss of one microbatch: the trainer's co-training loss
    (titan_spec/training/co_training.py, policy + lambda * draft) on the microbatch's logits and the
    taps the TapChannel brought.

    The co-training loss comes with each microbatch (``Microbatch.co_loss``: the trainer
    builds the draft after the pipeline); without one the loss is the policy's alone (plain
    LM training under PP)."""

    def __init__(self, loss_fn, channel: TapChannel | None, tap_ids: tuple[int, ...]):
        self.loss_fn, self.channel, self.tap_ids = loss_fn, channel, tap_ids
        self.policy_losses: list[torch.Tensor] = []
        self.policy_stats: dict[int, tuple[Any, int]] = {}
        """Microbatch index -> (its policy loss's stats, its valid label count) of the last step."""

    def __call__(self, logits_BLV: torch.Tensor, mb: Microbatch, global_valid_tokens: torch.Tensor | None = None):
        policy_loss = mb.policy_loss if mb.policy_loss is not None else self.loss_fn
        co_loss = mb.co_loss
        if co_loss is None or not torch.is_grad_enabled():
            if co_loss is not None:
                self.channel.take(mb.index)  # a forward without autograd trains no draft: its taps are dropped
            policy, stats = policy_loss(logits_BLV, mb.labels_BL, global_valid_tokens)
            self._record(mb, policy, stats)
            return policy, None
        got = self.channel.take(mb.index)
        taps = Taps(got[EMBEDS_TAP], tuple(got[k] for k in self.tap_ids))
        terms = co_loss(
            policy_loss,
            logits_BLV,
            taps,
            mb.labels_BL,
            global_valid_tokens,
            positions_BL=mb.positions_BL,
            attention_meta=mb.attention_masks,
            draft_count_S=mb.draft_count_S,
        )
        self._record(mb, terms.policy, terms.policy_stats)
        return terms.total, None

    def _record(self, mb: Microbatch, policy: torch.Tensor, stats) -> None:
        self.policy_losses.append(policy.detach())
        self.policy_stats[mb.index] = (stats, int((mb.labels_BL != IGNORE_INDEX).sum()))


# ---------------------------------------------------------------------------
# ModelSpec.pipelining_fn
# ---------------------------------------------------------------------------


def pipeline_spec(
    model: torch.nn.Module,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
    device: torch.device,
    model_config,
    parallelize_fn,
    loss_fn,
):
    """Same contract as torchtitan's ``pipeline_llm``: (schedule, model parts, has first
    stage, has last stage). Called through ``TapPipeline``, which keeps the schedule's
    PipelineLoss for the trainer."""
    pp_mesh = parallel_dims.get_mesh("pp")
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    schedule_name = parallelism.pipeline_parallel_schedule
    tap_ids = tuple(model_config.tap_layer_ids)
    names = stage_module_names(parallelism, len(model_config.layers), model_config)
    check_pipeline_split(names, tap_ids, draft=bool(tap_ids))
    n_stages = len(names)

    B, L, D = parallelism.pipeline_parallel_microbatch_size, training.seq_len, model_config.dim
    if parallel_dims.cp_enabled:
        # A CP rank's share of a microbatch is one packed stream of B*L/cp rows: documents are
        # padded to multiples of 2*cp (task.document_multiple), so the zigzag split adds none.
        B, L = 1, B * L // parallel_dims.cp
    dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]  # FSDP's param dtype = activation dtype
    channel = None
    if tap_ids:
        pp_ranks = dist.get_process_group_ranks(pp_mesh.get_group())
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, pp_ranks)
        all_pp_ranks = sorted({tuple(r) for r in every})
        channel = TapChannel(
            tap_layout(names, tap_ids, pp, schedule_name, (B, L, D), dtype),
            pp_ranks,
            pp_rank,
            device,
            timeout_s=TAP_TIMEOUT_S,
            all_pp_ranks=[list(r) for r in all_pp_ranks],
        )

    get_mesh = _build_get_mesh_callback(parallel_dims)
    stages, parts = [], []
    for s in _get_pp_rank_to_stage_indices_mapping(pp_rank, pp, schedule_name, n_stages):
        part = _split_module(model, names[s])
        part.stash_taps = True
        part = parallelize_fn(
            part,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder=dump_folder,
        )
        # Static metadata (meta tensors carry shape, dtype, requires_grad): no inference forward.
        meta = torch.device("meta")
        if s == 0:
            inputs = torch.empty(B, L, dtype=torch.int64, device=meta)
        else:
            inputs = torch.empty(B, L, D, dtype=dtype, device=meta, requires_grad=True)
        width = model_config.vocab_size if s == n_stages - 1 else D
        outputs = torch.empty(B, L, width, dtype=dtype, device=meta, requires_grad=True)
        stages.append(
            TapStage(
                part,
                s,
                n_stages,
                device,
                input_args=inputs,
                output_args=outputs,
                group=pp_mesh.get_group("pp"),
                get_mesh=get_mesh,
                channel=channel,
            )
        )
        parts.append(part)

    loss = PipelineLoss(loss_fn, channel, tap_ids)
    schedule = _build_pipeline_schedule(
        parallelism=parallelism, local_batch_size=training.local_batch_size, stages=stages, loss_fn=loss
    )
    return schedule, parts, any(st.is_first for st in stages), any(st.is_last for st in stages), loss


class TapPipeline:
    """titan_spec's ``ModelSpec.pipelining_fn``: ``pipeline_spec`` under torchtitan's contract
    (it returns what torchtitan's ``pipeline_llm`` returns), keeping the PipelineLoss it
    built in ``loss`` for the trainer (the schedule's own copy is private to torch)."""

    def __init__(self) -> None:
        self.loss: PipelineLoss | None = None
        """The built schedule's loss (None before the build)."""

    def __call__(self, model: torch.nn.Module, **kwargs):
        schedule, parts, has_first, has_last, self.loss = pipeline_spec(model, **kwargs)
        return schedule, parts, has_first, has_last


# ---------------------------------------------------------------------------
# Trainer.pp_forward_backward_step
# ---------------------------------------------------------------------------


class PipelineRun(NamedTuple):
    """What one pipelined forward/backward needs from the trainer that owns the schedule."""

    schedule: Any
    """torchtitan's pipeline schedule (pipeline_spec's)."""
    loss: PipelineLoss
    """The schedule's loss on the last stage (pipeline_spec's)."""
    has_first_stage: bool
    has_last_stage: bool
    device: torch.device
    train_context: Callable[[], Any]
    """The trainer's train context (a context manager factory)."""
    co_loss: Any = None
    """The co-training loss when a draft trains on this stage (each Microbatch carries it)."""


def pipeline_forward_backward(
    run: PipelineRun,
    microbatches: list[tuple],
    global_valid_tokens,
    policy_loss_mbs: list | None = None,
    forward_only: bool = False,
) -> torch.Tensor:
    """One pipelined forward+backward of the local batch; returns the policy loss (the sum
    of the microbatches' losses, each normalized by the global token count) on the last
    stage, -1 elsewhere, like torchtitan. ``microbatches``: each one's (inputs, labels,
    extra kwargs), already through the trainer's post_dataloading_process;
    ``policy_loss_mbs``: each microbatch's own policy loss (RL), in microbatch order; None =
    the schedule's loss_fn for all. ``forward_only``: the schedule's forward alone, without
    autograd (torch's ``schedule.eval``): the policy losses see their microbatches' logits
    (RL's recompute of the behaviour log-probs records them), no draft loss runs."""
    loss = run.loss
    arg_mbs, kwarg_mbs, targets = [], [], []
    if policy_loss_mbs is not None and len(policy_loss_mbs) != len(microbatches):
        raise ValueError(f"{len(policy_loss_mbs)} policy losses for {len(microbatches)} microbatches")
    for i, (inputs, labels, extra) in enumerate(microbatches):
        arg_mbs.append((inputs,))
        kwarg_mbs.append(extra)
        own = policy_loss_mbs[i] if policy_loss_mbs is not None else None
        targets.append(
            Microbatch(i, labels, extra.get("positions"), extra.get("attention_masks"), None, own, run.co_loss)
        )
    if run.co_loss is not None:
        count_S = run.co_loss.draft.normalizer(
            [t.positions_BL for t in targets], [t.labels_BL for t in targets], [t.attention_masks for t in targets]
        )
        targets = [t._replace(draft_count_S=count_S) for t in targets]
    if loss.channel is not None:
        loss.channel.begin_step(len(targets))
    loss.policy_losses, loss.policy_stats = [], {}
    with run.train_context():
        feed = {
            "arg_mbs": arg_mbs if run.has_first_stage else None,
            "kwarg_mbs": kwarg_mbs,
            "target_mbs": targets if run.has_last_stage else None,
            "losses": [] if run.has_last_stage else None,
        }
        if forward_only:
            with torch.no_grad():
                run.schedule.eval(**feed)
        else:
            run.schedule.step(**feed, loss_kwargs={"global_valid_tokens": global_valid_tokens}, return_outputs=False)
    if loss.channel is not None:
        loss.channel.end_step()
    if run.has_last_stage:
        return torch.stack(loss.policy_losses).sum().to(run.device)
    return torch.tensor([-1.0], device=run.device)


def check_schedule(parallelism, local_batch_size: int) -> None:
    """Microbatch counts the schedule can use (ValueError, one line); config-only."""
    name = parallelism.pipeline_parallel_schedule
    if name not in SCHEDULES:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is not allowed; it must be one of "
            f"{', '.join(SCHEDULES)}"
        )
    mb = parallelism.pipeline_parallel_microbatch_size
    if mb < 1 or local_batch_size % mb:
        raise ValueError(
            f"parallelism.pipeline_parallel_microbatch_size = {mb} must be >= 1 and divide "
            f"training.local_batch_size = {local_batch_size}"
        )
    n = local_batch_size // mb
    pp = parallelism.pipeline_parallel_degree
    single = issubclass(get_schedule_class(name), PipelineScheduleSingle)
    if name == "1F1B" and n < pp:
        raise ValueError(
            f"schedule 1F1B needs at least as many microbatches as stages: {n} microbatches "
            f"(local_batch_size {local_batch_size} / microbatch_size {mb}) < {pp} stages"
        )
    if not single:
        rounds = max(1, n // pp)
        if n % rounds:
            raise ValueError(
                f"schedule {name} needs the microbatch count to be a multiple of max(1, microbatches // pp) = "
                f"{rounds}; {n} microbatches (local_batch_size {local_batch_size} / microbatch_size {mb}) is not"
            )


# ---------------------------------------------------------------------------
# The RL weight push: whole models out of the stages, on every rank
# ---------------------------------------------------------------------------


def gather_over_stages(local: dict[str, torch.Tensor], pp_mesh, device) -> dict[str, torch.Tensor]:
    """Every stage's ``local`` tensors (its full, FSDP-gathered part of the model, names
    disjoint across stages) on every rank of the pp group (collective over it)."""
    return _share_over_pp(local, pp_mesh, device, sources=range(pp_mesh.size()))


def broadcast_from_last_stage(local: dict[str, torch.Tensor] | None, pp_mesh, device) -> dict[str, torch.Tensor]:
    """The last pipeline rank's ``local`` tensors (the draft: it lives there) on every rank
    of the pp group (collective over it; the other ranks pass None)."""
    return _share_over_pp(local, pp_mesh, device, sources=[pp_mesh.size() - 1])


def _share_over_pp(local, pp_mesh, device, sources) -> dict[str, torch.Tensor]:
    # One object all-gather for the names, shapes and dtypes, then one broadcast per tensor
    # from the pp rank that holds it (device tensors: NCCL moves no CPU tensors).
    group, me = pp_mesh.get_group(), pp_mesh.get_local_rank()
    ranks = dist.get_process_group_ranks(group)
    mine = {k: (tuple(v.shape), v.dtype) for k, v in (local or {}).items()} if me in sources else {}
    every: list = [None] * pp_mesh.size()
    dist.all_gather_object(every, mine, group=group)
    out: dict[str, torch.Tensor] = {}
    for src in sources:
        for name, (shape, dtype) in every[src].items():
            if name in out:
                raise RuntimeError(f"pipeline ranks {sorted(s for s in sources if name in every[s])} both hold {name}")
            t = (
                local[name].detach().to(device).contiguous()
                if src == me
                else torch.empty(shape, dtype=dtype, device=device)
            )
            dist.broadcast(t, src=ranks[src], group=group)
            out[name] = t
    return out
