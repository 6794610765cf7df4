"""Stand-ins for RLTrainer's collaborators, so the REAL RLTrainer methods run in-process on a
tiny model without torchrun or a torchtitan Trainer: ``rollout_step`` runs phases 2-5 of
``RLTrainer.train_step`` (``RolloutGeneration.generate``: prompts -> scripted completions;
``score``: rewards; group advantages; ``pack``: the packed minibatch). Only attributes those methods read are provided; a method that starts
reading another one fails here with an AttributeError, not silently."""

from __future__ import annotations

from types import SimpleNamespace


from titan_spec.config import RLConfig
from titan_spec.data.rewards import exact_match
from titan_spec.rl.grpo import group_advantages
from titan_spec.rl.generation import RolloutGeneration
from titan_spec.rl.step import RLTrainer
from titan_spec.rollout.base import Rollout

BOS, EOS, PAD = 1, 2, 0
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz? "


class CharTokenizer:
    """One token per character (ids 3..), BOS 1, EOS 2, pad 0."""

    bos_id, eos_id, pad_id = BOS, EOS, PAD
    stop_ids = (EOS,)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([BOS] if add_bos else []) + [3 + ALPHABET.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(ALPHABET[i - 3] for i in ids if i >= 3)


class ScriptedWorker:
    """generate() answers each prompt with the next scripted completion of ITS problem, found
    by the prompt's text, so the result does not depend on how the loop orders the prompts."""

    def __init__(self, tok: CharTokenizer, script: dict[str, list[str]]):
        self.tok, self.script, self.pushes = tok, script, []

    def push(self, policy_state, draft_state, version):
        self.pushes.append((draft_state, version))

    def generate(self, prompts, sampling):
        from titan_spec.rl.worker import RolloutStats

        taken: dict[str, int] = {}
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            k = taken[text] = taken.get(text, -1) + 1
            ids = self.tok.encode(self.script[text][k])
            out.append(Rollout(list(p), ids, [-0.5] * len(ids), "length", verify_steps=len(ids)))
        return out, RolloutStats.of(out, 0.0)


def rollout_step(
    problems: list[tuple[str, str, list[str]]],
    seq_len: int = 64,
    scale_advantages: bool = True,
    pp_rows: int | None = None,
):
    """Phases 2-5 of ``RLTrainer.train_step`` over ``problems`` = (prompt, answer, its G
    completions), one minibatch. Returns (input dict with the minibatch's "input",
    "positions", "behaviour_logp" and "advantages", labels_BL, tokenizer). ``pp_rows``: pack
    as under pipeline parallelism, into training.local_batch_size = pp_rows rows."""
    tok = CharTokenizer()
    G = len(problems[0][2])
    rl = RLConfig(
        enable=True,
        prompts_per_step=len(problems),
        group_size=G,
        baseline_interval=0,
        scale_advantages=scale_advantages,
        max_new_tokens=8,
    )
    worker = ScriptedWorker(tok, {p: c for p, _, c in problems})
    dataloader = SimpleNamespace(
        batch_index=0,
        dp_rank=0,
        document_multiple=1,
        next_problems=lambda n: [SimpleNamespace(prompt=p, answer=a) for p, a, _ in problems[:n]],
        prompt_ids=lambda problem: tok.encode(problem.prompt, add_bos=True),
    )
    fake = SimpleNamespace(
        tokenizer=tok,
        rl=rl,
        step=1,
        dataloader=dataloader,
        parallel_dims=SimpleNamespace(dp_enabled=False, cp_enabled=False, pp_enabled=pp_rows is not None),
        reward=exact_match,
        config=SimpleNamespace(
            task=SimpleNamespace(seed=0, reward="exact_match"),
            training=SimpleNamespace(seq_len=seq_len, local_batch_size=pp_rows or 1),
        ),
    )
    # The real generation (one process: no generation shared) and the real methods, on the stand-in.
    generation = RolloutGeneration(rl, 0, tok, dataloader, worker, None)
    batch = generation.generate(fake.step, RLTrainer._policy_version(fake), 0.0)
    rewards_PG = RLTrainer.score(fake, batch)
    (mb,) = RLTrainer.pack(fake, batch, group_advantages(rewards_PG, rl.scale_advantages))
    inputs = {**mb.inputs, "behaviour_logp": mb.values_BL["behaviour_logp"], "advantages": mb.values_BL["advantages"]}
    return inputs, mb.labels_BL, tok
