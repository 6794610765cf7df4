"""The inputs a config names, checked before anything is built: its directories exist, its
task file reads, a 'records' task's prompts fit training.seq_len, the reward function
resolves and scores, the rollout engine can start from them (preflight/engines.py)."""

from __future__ import annotations

import os
import random
import tempfile

from titan_spec.config import ConfigError, TaskConfig, TitanSpecConfig, check_paths
from titan_spec.data.rewards import RewardError, reward_fn, score
from titan_spec.data.tasks import AnswerFormatError, build_task
from titan_spec.preflight.engines import check_sglang_config, check_vllm_config
from titan_spec.preflight.lengths import check_records_fit
from titan_spec.preflight.resolve import Made

__all__ = ["check_chat_template", "check_free_space", "check_inputs", "check_reward", "check_writable"]


def check_inputs(cfg: TitanSpecConfig, made: dict[str, Made] | None = None) -> None:
    """The inputs a config names, before anything is built: its directories exist
    (config.check_paths), its task file reads (``check_task_file``), a 'records' task's
    prompts fit training.seq_len (preflight/lengths.py ``check_records_fit``), the reward resolves
    and scores (``check_reward``, ``check_reward_scores``), the SGLang or vLLM
    engine can start from them (preflight/engines.py). ``made``: directories
    an earlier run of the chain writes (not there yet; see ``Made``). Raises ConfigError,
    not yet located (``validate_run`` says where the value came from)."""
    made = made or {}
    check_paths(cfg, made)
    check_writable(cfg.job.dump_folder)
    check_task_file(cfg.task)
    check_records_fit(cfg)
    check_reward(cfg.task.reward)
    check_reward_scores(cfg)
    written = {os.path.abspath(cfg.model.hf_checkpoint), os.path.abspath(cfg.draft.init_from)} & set(made)
    check_sglang_config(cfg, files=not written)
    check_vllm_config(cfg, files=not written)
    if cfg.rollout.engine == "sglang" and not written:
        _check_sglang_tokenizer(cfg)


def check_task_file(task_cfg: TaskConfig) -> None:
    """A [task] that reads a file (name = 'jsonl' or 'dataset') can read it: one ConfigError
    line (key task.path) naming the file and its malformed records, or the configured field
    no record has, before any run starts. Generated tasks read no file ('records' has its own
    check, check_records_fit)."""
    if task_cfg.name not in ("jsonl", "dataset"):
        return
    try:
        build_task(task_cfg)
    except AnswerFormatError as e:  # the format is at fault, not the file
        raise ConfigError(str(e), key="task.answer_format") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"task.path: {e}", key="task.path") from None


def check_reward(name: str) -> None:
    """``task.reward`` names a reward (data/rewards.py ``reward_fn``), before any run starts."""
    try:
        reward_fn(name)
    except ValueError as e:
        raise ConfigError(str(e), key="task.reward") from None


REWARD_PROBES = 4
"""Problems of the task a reward scores before an RL run starts (each with 2 completions)."""


def check_reward_scores(cfg: TitanSpecConfig) -> None:
    """An RL run's reward gives a finite number before the first step: on the first
    REWARD_PROBES problems the task hands out, for their reference answer (what SFT shows)
    and for an empty completion (what an untrained policy may write). A reward that raises
    or returns a non-number for these is otherwise found at step 1, after every rank has
    built its model and engine; one that fails only on other completions is still a
    RewardError naming the record at its step (data/rewards.py ``score``)."""
    if cfg.mode.trains != "rl":
        return
    rng = random.Random(cfg.task.seed)
    task = build_task(cfg.task)
    problems = [task.sample(rng) for _ in range(REWARD_PROBES)]
    try:
        score(
            reward_fn(cfg.task.reward),
            cfg.task.reward,
            [p.sft_target for p in problems] + [""] * len(problems),
            problems * 2,
        )
    except RewardError as e:
        raise ConfigError(
            f"task.reward = {cfg.task.reward!r} does not score the task before the start: {e}; allowed: "
            "a function (completion, answer, record) -> a finite number",
            key="task.reward",
        ) from None


def check_chat_template(task: TaskConfig, tokenizer) -> None:
    """task.chat_template = 'on' and task.system_prompt need a tokenizer with a chat template
    (data/prompts.py renders the prompt through it)."""
    has = getattr(tokenizer, "chat_template", None) is not None
    if task.chat_template == "on" and not has:
        raise ConfigError(
            "task.chat_template = 'on' but the tokenizer has no chat template "
            "(tokenizer_config.json chat_template or chat_template.jinja)",
            key="task.chat_template",
        )
    if task.system_prompt and not (has and task.chat_template != "off"):
        raise ConfigError(
            "task.system_prompt needs a chat template, and the tokenizer has none", key="task.system_prompt"
        )


def check_writable(dump: str) -> None:
    """job.dump_folder can be made and written, and so can every folder a former run left in it
    (checkpoint/, comm_traces/, tb/, ...): a file is made and removed in each (the permission
    bits alone do not say it: root ignores them, a read-only mount does not). Otherwise the
    first write of the run is a traceback (torchtitan's comm_traces, the first checkpoint)."""
    where = os.path.abspath(dump)
    while not os.path.exists(where):  # the folder the run will make its dump folder in
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise ConfigError(f"job.dump_folder {dump!r} cannot be made: {where} is a file", key="job.dump_folder")
    folders = [where]
    if where == os.path.abspath(dump):
        folders += sorted(e.path for e in os.scandir(where) if e.is_dir(follow_symlinks=False))
    for folder in folders:
        try:
            fd, probe = tempfile.mkstemp(prefix=".titan_spec_write_check_", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(
                f"job.dump_folder {dump!r} is not writable: {folder}: {e.strerror or e}; allowed: a folder this "
                "user can create files in (the run writes its checkpoints, metrics and exports there)",
                key="job.dump_folder",
            ) from None


CHECKPOINT_BYTES_PER_PARAMETER = 12
"""What one DCP checkpoint holds per trained fp32 parameter: the weight and AdamW's two
moments (4 bytes each). The estimate of ``check_free_space``."""


def check_free_space(cfg: TitanSpecConfig, policy_parameters: int, draft_parameters: int) -> None:
    """The disk under job.dump_folder has room for one checkpoint of the run (policy and
    draft, CHECKPOINT_BYTES_PER_PARAMETER each, with checkpoint.enable) and the fp32 exports
    it writes (the policy with job.export_hf, the draft): a disk that cannot take the first
    checkpoint is refused now, by name, rather than at that checkpoint (training/checkpoint.py
    still names a disk that fills later). A lower bound: later checkpoints, TensorBoard and
    metrics need more."""
    everything = policy_parameters + draft_parameters
    exported = draft_parameters + (policy_parameters if cfg.job.export_hf else 0)
    need = CHECKPOINT_BYTES_PER_PARAMETER * everything * cfg.checkpoint.enable + 4 * exported
    where = os.path.abspath(cfg.job.dump_folder)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ConfigError(
            f"job.dump_folder {cfg.job.dump_folder!r} has no space left for the run: {where} has {free / 2**20:.1f} MiB "
            f"free, one checkpoint and the exports of {everything:,} parameters need {need / 2**20:.1f} MiB; allowed: "
            "a folder on a disk with that much free space (or checkpoint.enable = false)",
            key="job.dump_folder",
        )


def _check_sglang_tokenizer(cfg: TitanSpecConfig) -> None:
    """SGLang serves model.hf_checkpoint with ITS tokenizer files (token ids in and out, but
    its EOS handling and any text it reports are that directory's): a tokenizer.path
    elsewhere must hold the same tokenizer.json, or the engines disagree on the ids."""
    ours, served = cfg.tokenizer.path, cfg.model.hf_checkpoint
    if not ours or not served or os.path.realpath(ours) == os.path.realpath(served):
        return

    def content(d: str) -> bytes | None:
        f = os.path.join(d, "tokenizer.json")
        if not os.path.isfile(f):
            return None
        with open(f, "rb") as fh:
            return fh.read()

    served_json = content(served)
    if served_json is not None and content(ours) != served_json:
        raise ConfigError(
            f"tokenizer.path {ours!r} is not the tokenizer SGLang serves model.hf_checkpoint {served!r} with "
            "(their tokenizer.json differ): leave tokenizer.path empty, or copy the tokenizer into the checkpoint",
            key="tokenizer.path",
        )
