"""RL building blocks: packing of RL values, the co-training objective's gradient separation,
the rollout worker (weight push, retry on engine failure), task files, run planning, RL
config errors. The end-to-end runs are in test_rl_e2e.py."""

import dataclasses
import json
import math
import os

import pytest
import torch

import titan_spec  # noqa: F401
from titan_spec.config import ConfigError, DraftConfig, Eagle3Config, RLConfig, load_config
from titan_spec.training.draft import DraftTraining
from titan_spec.models.attention import doc_metadata_from_positions
from titan_spec.models.draft.eagle3.model import DraftArch
from titan_spec.models.registry import build_target_config, flavor_arch, with_vocab
from titan_spec.training.co_training import CoTrainingLoss
from helpers.policy_loss import ppo_policy_loss
from titan_spec.rl.logprobs import token_logprobs
from titan_spec.data.packing import Document, pack_documents
from titan_spec.rollout import SamplingParams
from titan_spec.data.tasks import JsonlTask
from conftest import load_checked

IGNORE = -100
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_packing_places_rl_values_on_the_completion_labels():
    # doc a: 3 prompt + 2 completion tokens; doc b: 2 prompt + 3 completion tokens
    a = Document([1, 5, 6, 7, 8], loss_from=3, values={"adv": [0.5, 0.5], "lp": [-1.0, -2.0]})
    b = Document([1, 9, 10, 11, 12], loss_from=2, values={"adv": [-1.0] * 3, "lp": [-3.0, -4.0, -5.0]})
    packed, used = pack_documents([a, b], None, 8, pad_id=0)
    assert used == 2 and packed.input_BL.shape == (2, 8)  # b does not fit after a: a second row
    # a's completion tokens 7, 8 are the labels of positions 2, 3
    assert packed.labels_BL[0, :5].tolist() == [IGNORE, IGNORE, 7, 8, IGNORE]
    assert packed.values_BL["lp"][0, :5].tolist() == [0.0, 0.0, -1.0, -2.0, 0.0]
    assert packed.values_BL["adv"][1, :5].tolist() == [0.0, -1.0, -1.0, -1.0, 0.0]
    assert packed.labels_BL[1, :5].tolist() == [IGNORE, 10, 11, 12, IGNORE]
    with pytest.raises(ValueError, match="2 values for 3 targets"):
        pack_documents([Document([1, 2, 3, 4], loss_from=1, values={"x": [0.0, 0.0]})], None, 8, 0)


def _tiny(vocab=40, seed=0):
    torch.manual_seed(seed)
    arch = with_vocab(flavor_arch("qwen3", "tiny"), vocab)
    model = build_target_config(arch, tap_layer_ids=(1, 3, 4), max_seq_len=64).build()
    model.init_weights(buffer_device=None)
    return model, arch


def _batch(vocab=40, seed=1, multiple=1):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(5):
        p = torch.randint(3, vocab, (4,), generator=g).tolist()
        c = torch.randint(3, vocab, (3 + i % 3,), generator=g).tolist()
        docs.append(
            Document(
                [1] + p + c,
                loss_from=5,
                values={
                    "behaviour_logp": (-torch.rand(len(c), generator=g) * 3).tolist(),
                    "advantages": [float(i % 3) - 1.0] * len(c),
                },
            )
        )
    packed, _ = pack_documents(docs, None, 32, pad_id=0, multiple=multiple)
    return packed


def test_documents_padded_to_a_multiple_keep_their_real_tokens_logits_and_labels():
    """task.document_multiple: pad tokens continue a document's positions with ignored labels,
    so a causal model's logits and the labels of the real tokens are those of tight packing."""
    model, _ = _tiny()
    tight, aligned = _batch(), _batch(multiple=4)
    out = {}
    for name, packed in (("tight", tight), ("aligned", aligned)):
        with torch.no_grad():
            logits_BLV, _ = model(
                packed.input_BL,
                positions=packed.positions_BL,
                attention_masks=model.get_attention_masks(packed.positions_BL),
            )
        starts = (packed.positions_BL.reshape(-1) == 0).nonzero().flatten().tolist()
        ends = starts[1:] + [packed.positions_BL.numel()]
        docs = [(s, e) for s, e in zip(starts, ends) if packed.input_BL.reshape(-1)[s] == 1]  # BOS: a document
        out[name] = [
            (
                packed.input_BL.reshape(-1)[s:e],
                packed.labels_BL.reshape(-1)[s:e],
                logits_BLV.reshape(-1, logits_BLV.shape[-1])[s:e],
            )
            for s, e in docs
        ]
        if name == "aligned":
            assert all((e - s) % 4 == 0 for s, e in docs)
    assert len(out["tight"]) == len(out["aligned"]) == 5
    for (tok_a, lab_a, log_a), (tok_b, lab_b, log_b) in zip(out["tight"], out["aligned"]):
        n = int((tok_a != 0).sum())  # a tight document has no pad tokens
        assert (tok_b[:n] == tok_a[:n]).all() and (tok_b[n:] == 0).all()
        assert (lab_b[:n] == lab_a[:n]).all() and (lab_b[n:] == IGNORE).all()
        torch.testing.assert_close(log_b[:n], log_a[:n], rtol=1e-5, atol=1e-5)


def test_co_training_loss_gradients_reach_each_model_only_through_its_own_loss():
    model, arch = _tiny()
    draft_cfg = DraftConfig(enable=True, eagle3=Eagle3Config(ttt_steps=3))
    dt = DraftTraining(
        draft_cfg,
        DraftArch.from_target(arch, (1, 3, 4), arch.vocab_size),
        device=torch.device("cpu"),
        dp_mesh=None,
        lr_scheduler_cfg=load_config(None).lr_scheduler,
        training_steps=10,
        token_counts_V=None,
        seed=0,
    )
    rl = RLConfig(enable=True, temperature=0.7, kl_beta=0.0)
    b = _batch()
    meta = doc_metadata_from_positions(b.positions_BL)
    n_tokens = torch.tensor(int((b.labels_BL != IGNORE).sum()))
    policy_params = list(model.parameters())
    draft_params = [p for p in dt.draft.parameters() if p.requires_grad]

    def grads(which: str):
        model.zero_grad(set_to_none=True)
        dt.zero_grad()
        logits, taps = model(b.input_BL, positions=b.positions_BL, attention_masks=meta)
        policy = ppo_policy_loss(b.values_BL["behaviour_logp"], b.values_BL["advantages"], rl, n_tokens)
        out = CoTrainingLoss(dt, weight=0.5)(
            policy,
            logits,
            taps,
            b.labels_BL,
            n_tokens,
            positions_BL=b.positions_BL,
            attention_meta=meta,
        )
        {"total": out.total, "policy": out.policy, "draft": out.draft.loss}[which].backward()
        zero = lambda ps: [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in ps]  # noqa: E731
        return zero(policy_params), zero(draft_params), out

    p_total, d_total, out = grads("total")
    p_pol, d_pol, _ = grads("policy")
    p_dr, d_dr, _ = grads("draft")
    assert all(g.abs().sum() == 0 for g in d_pol), "the policy loss must not reach the draft"
    assert all(g.abs().sum() == 0 for g in p_dr), "the draft loss must not reach the policy (taps/logits detached)"
    assert any(g.abs().sum() > 0 for g in p_pol) and any(g.abs().sum() > 0 for g in d_dr)
    for a, c in zip(p_total, p_pol):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
    for a, c in zip(d_total, d_dr):
        torch.testing.assert_close(a, 0.5 * c, rtol=1e-5, atol=1e-7)
    # The policy loss is the PPO-clip loss on log softmax(logits / T) at the labels.
    with torch.no_grad():
        logits, _ = model(b.input_BL, positions=b.positions_BL, attention_masks=meta)
        lp = torch.log_softmax(logits.double() / 0.7, -1)
        mask = b.labels_BL != IGNORE
        ref = lp.gather(-1, b.labels_BL.clamp(min=0)[..., None])[..., 0]
        torch.testing.assert_close(
            token_logprobs(logits, b.labels_BL, 0.7)[mask], ref[mask].float(), rtol=1e-5, atol=1e-5
        )
        ratio = torch.exp(ref[mask].float() - b.values_BL["behaviour_logp"][mask])
        adv = b.values_BL["advantages"][mask]
        expect = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum() / n_tokens
    assert out.policy.item() == pytest.approx(expect.item(), rel=1e-4)


def _worker(tmp_path, retries=1, costs_dir=None):
    from titan_spec.training.draft import initial_draft
    from titan_spec.rl.worker import RolloutWorker

    model, arch = _tiny()
    cfg = load_config(
        None,
        [
            "--rl.enable",
            "true",
            "--draft.enable",
            "true",
            "--rl.rollout_retries",
            str(retries),
            "--rl.baseline_interval",
            "1",
            "--rollout.progress",
            "false",
        ],
    )
    darch = DraftArch.from_target(arch, (1, 3, 4), 24)
    draft = initial_draft(cfg.draft, darch, torch.arange(arch.vocab_size).flip(0), seed=3)
    worker = RolloutWorker(cfg, arch, torch.device("cpu"), draft, costs_dir=costs_dir)
    worker.push(model.state_dict(), None, version=7)
    return worker, model


def test_rollout_worker_keeps_its_depth_cost_table_for_a_resume(tmp_path):
    """Adaptive depth (the default): the worker's engines share one cost table, measured on
    the first call and written to costs_dir; a new worker over the same folder (a resumed
    run) reads it instead of measuring, so it makes the same depth choices and samples the
    same rollouts, and the file does not change."""
    worker, _ = _worker(tmp_path, costs_dir=str(tmp_path))
    assert worker.main.adaptive and worker.baselines.frozen.costs is worker.main.costs
    prompts = [[1, 5, 6], [1, 7], [1, 9, 9, 9]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    first, stats = worker.generate(prompts, sp)
    path = tmp_path / "rollout_costs.rank0.json"
    saved = path.read_text()
    assert json.loads(saved) == worker.costs.state_dict() and len(worker.costs) == 3  # batch buckets 1, 2, 4
    assert stats.drafted_tokens == sum(r.drafted_tokens for r in first) and stats.rounds == stats.verify_steps - 3
    resumed, _ = _worker(tmp_path, costs_dir=str(tmp_path))
    assert resumed.costs.state_dict() == worker.costs.state_dict()
    again, _ = resumed.generate(prompts, sp)
    assert [r.output_ids for r in again] == [r.output_ids for r in first]
    assert resumed.main.last_depths == worker.main.last_depths
    assert path.read_text() == saved
    # The acceptance estimates carry from call to call; a resumed run loads them from the
    # checkpoint (RLTrainer.state_dict): its next call is the uninterrupted run's next call.
    state = json.loads(json.dumps(worker.state_dict()))
    assert set(state) == {"main", "frozen"} and state["main"] and not state["frozen"]  # frozen: not run yet
    nxt, _ = worker.generate(prompts, dataclasses.replace(sp, seed=4))
    later, _ = _worker(tmp_path, costs_dir=str(tmp_path))
    later.load_state_dict(state)
    assert [r.output_ids for r in later.generate(prompts, dataclasses.replace(sp, seed=4))[0]] == [
        r.output_ids for r in nxt
    ]
    assert later.main.last_depths == worker.main.last_depths


def test_baselines_measure_both_drafts_at_fixed_depth_whatever_adaptive_depth_chose(tmp_path):
    """issue 30: at baseline steps the worker also runs the step's draft and the frozen one at
    FIXED K = speculative.num_draft_tokens on the same prompts and seed. Before any draft push
    the two are the same draft: identical counts. A pushed draft reaches the fixed engine of
    the step's draft (it shares the module) and not the frozen one; every fixed round drafts
    K tokens (budget permitting), whatever K the adaptive engines chose."""
    worker, _ = _worker(tmp_path)
    K = worker.cfg.speculative.num_draft_tokens
    sweep = [f"fixed_k{k}" for k in range(1, K)]  # adaptive depth's regret: every smaller fixed K
    engines = worker.baselines.engines
    assert K == 4 and list(engines) == ["frozen", "nospec", "fixed", "frozen_fixed", *sweep]
    assert engines["fixed"].draft is worker.main.draft and engines["frozen_fixed"].draft is engines["frozen"].draft
    assert all(engines[n].draft is worker.main.draft for n in sweep)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 9, 9]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)
    base = worker.baselines.measure(prompts, sp)
    assert list(base) == ["frozen", "nospec", "fixed", "frozen_fixed", *sweep]
    for k in range(1, K):  # k per round, but the last rounds of a request (budget)
        s = base[f"fixed_k{k}"]
        assert s.rounds > 0 and k * s.rounds >= s.drafted_tokens >= 0.8 * k * s.rounds, (k, s)
        # Each decode round is recorded with its K and rows (the call's rows, falling as
        # requests finish) and priced by the shared cost table, as one clock for all.
        rounds = engines[f"fixed_k{k}"].last_rounds
        assert {r[0] for r in rounds} == {k} and [r[1] for r in rounds] == sorted((r[1] for r in rounds), reverse=True)
        assert rounds[0][1] == len(prompts) and s.priced_s > 0
    # Priced by the same table, one K = 0 round of a row costs less than one K = 4 round of it.
    assert base["nospec"].priced_s / base["nospec"].tokens < base["fixed"].priced_s / base["fixed"].rounds
    fixed, frozen = base["fixed"], base["frozen_fixed"]
    assert (fixed.tokens, fixed.verify_steps, fixed.drafted_tokens) == (
        frozen.tokens,
        frozen.verify_steps,
        frozen.drafted_tokens,
    )
    assert fixed.rounds > 0 and fixed.drafted_tokens > 0.8 * K * fixed.rounds  # K per round but the last ones
    # A different draft pushed into the step's engines (the co-trained one moved).
    moved = {
        k: (v + 0.05 * torch.randn_like(v)) if v.is_floating_point() else v
        for k, v in worker.main.draft.state_dict().items()
    }
    worker.push(worker.target.state_dict(), moved, version=8)
    assert torch.equal(engines["fixed"].draft.fc.weight, moved["fc.weight"])
    again = worker.baselines.measure(prompts, sp)
    assert (again["frozen_fixed"].tokens, again["frozen_fixed"].verify_steps) == (frozen.tokens, frozen.verify_steps)
    assert (again["fixed"].verify_steps, again["fixed"].tokens) != (fixed.verify_steps, fixed.tokens)


def test_rollout_worker_retries_a_failed_engine_and_stops_with_a_clear_message(tmp_path):
    worker, _ = _worker(tmp_path)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 9, 9]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    start = worker.main_depth_state()
    clean, stats = worker.generate(prompts, sp)
    assert stats.tokens == sum(len(r.output_ids) for r in clean) and all(r.policy_version == 7 for r in clean)

    calls = {"n": 0}
    real = worker.main._generate_batch

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            real(*a, **k)  # the whole batch ran (its rounds updated the acceptance estimate) ...
            raise RuntimeError("simulated engine crash")  # ... and then the engine failed
        return real(*a, **k)

    worker.main._generate_batch = flaky
    worker.load_main_depth_state(start)  # the same call again, from the same depth state
    again, _ = worker.generate(prompts, sp)
    # Retried on a rebuilt engine over the same weights, seed and starting depth state
    # (the worker restores it): the same rollouts.
    assert calls["n"] == 1 and [r.output_ids for r in again] == [r.output_ids for r in clean]
    assert all(r.policy_version == 7 for r in again)

    def dead(*a, **k):
        raise RuntimeError("simulated engine crash")

    worker.main._generate_batch = dead
    worker._rebuild = lambda: _dead_engine(worker)
    # The stop message says what a rerun does as the trainer knows it (RLTrainer._resume_hint:
    # "resume from" only when a verified checkpoint exists), never a blanket claim.
    worker.resume_hint = lambda: "no verified checkpoint exists yet: a rerun starts from the beginning"
    with pytest.raises(RuntimeError, match=r"failed 2 time\(s\).*stops here; no verified checkpoint exists yet"):
        worker.generate(prompts, sp)
    # The baselines run the same prompts with the frozen draft and without speculation.
    base = worker.baselines.measure(prompts, sp)
    sweep = [f"fixed_k{k}" for k in range(1, worker.cfg.speculative.num_draft_tokens)]
    assert set(base) == {"frozen", "nospec", "fixed", "frozen_fixed", *sweep}
    assert base["nospec"].verify_steps == base["nospec"].tokens
    # In turned-over order (every other baseline step) no-spec runs first, with the same result;
    # the fixed-depth measurements come after the trio either way.
    turned = worker.baselines.measure(prompts, sp, reverse=True)
    assert list(turned) == ["nospec", "frozen", "fixed", "frozen_fixed", *sweep]
    assert turned["nospec"].tokens == base["nospec"].tokens


def test_baseline_schedule_which_steps_and_which_order():
    """rl/baselines.py: step 1 and every rl.baseline_interval-th step are baseline steps (0:
    none); every other baseline step runs the baselines before the step's call, the others
    after it; the step's stats come back priced, the baselines' by name."""
    from titan_spec.rl.baselines import Baselines, is_baseline_step, turned_over
    from titan_spec.rl.worker import RolloutStats

    assert [s for s in range(1, 31) if is_baseline_step(s, 10)] == [1, 10, 20, 30]
    assert [s for s in range(1, 6) if is_baseline_step(s, 1)] == [1, 2, 3, 4, 5]
    assert not any(is_baseline_step(s, 0) for s in range(1, 31))
    assert [turned_over(s, 10) for s in (1, 10, 20, 30)] == [False, True, False, True]
    assert [turned_over(s, 1) for s in (1, 2, 3)] == [True, False, True]

    calls = []

    class Recording(Baselines):
        def measure(self, prompts, sampling, reverse=False):
            calls.append("baselines reversed" if reverse else "baselines")
            return {"nospec": RolloutStats(1, 1, 0.5)}

        def priced_main(self, sampling):
            return 2.5

    def generate(prompts, sampling):
        calls.append("step")
        return ["rollout"], RolloutStats(3, 2, 1.0)

    b = Recording(10)
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    for step, want in ((1, ["step", "baselines"]), (10, ["baselines reversed", "step"]), (20, ["step", "baselines"])):
        calls.clear()
        rollouts, stats, base = b.run(step, [[1, 2]], sp, generate)
        assert calls == want and rollouts == ["rollout"] and list(base) == ["nospec"]
        assert (stats.tokens, stats.verify_steps, stats.seconds, stats.priced_s) == (3, 2, 1.0, 2.5)
    # Nothing to measure (SGLang, no draft): the step's call alone, unpriced.
    calls.clear()
    assert Baselines(10).run(10, [[1, 2]], sp, generate)[1:] == (RolloutStats(3, 2, 1.0), {}) and calls == ["step"]


def _dead_engine(worker):
    from titan_spec.rollout.builtin.engine import BuiltinRolloutEngine

    e = BuiltinRolloutEngine(worker.target, worker.draft, worker.engine_config)

    def dead(*a, **k):
        raise RuntimeError("simulated engine crash")

    e._generate_batch = dead
    return e


def test_jsonl_task_reports_malformed_lines_and_rejects_or_skips(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(
        '{"question": "1+1?", "answer": "two #### 2"}\n'
        "not json\n"
        '{"question": "2+2?", "answer": "4"}\n'
        "\n"
        '{"answer": "#### 3"}\n'
        '{"question": "3+3?", "answer": "so #### 6"}\n'
    )
    with pytest.raises(ValueError, match=r"3 malformed line\(s\) \(lines 2, 3, 5\)"):
        JsonlTask(str(path))
    task = JsonlTask(str(path), on_malformed="skip")
    assert [p.answer for p in task.problems] == ["2", "6"] and len(task.errors) == 3
    assert "gsm.jsonl:5: missing field 'question'" in task.errors[2]
    # Through the config: one line before any run starts.
    with pytest.raises(ConfigError, match=r"task.path: .*lines 2, 3, 5.*task.on_malformed = 'skip'"):
        load_checked(None, ["--task.name", "jsonl", "--task.path", str(path)])
    cfg = load_checked(None, ["--task.name", "jsonl", "--task.path", str(path), "--task.on_malformed", "skip"])
    assert cfg.task.on_malformed == "skip"


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--draft.enable", "true", "--speculative.enabled", "false"],
            "draft.co_train = true needs speculative.enabled",
        ),
        (["--draft.enable", "false"], "needs a draft"),
        (["--draft.enable", "true", "--draft.offline", "true"], "draft.offline = true freezes the policy"),
        (["--draft.enable", "true", "--rl.prompts_per_step", "3"], "multiple of the 2 data-parallel ranks"),
        (["--draft.enable", "true", "--rl.group_size", "1"], "rl.group_size"),
        (["--draft.enable", "true", "--rl.temperature", "0"], "rl.temperature"),
        (
            ["--draft.enable", "true", "--rl.prompts_per_step", "6", "--rl.group_size", "3", "--rl.minibatches", "2"],
            "rl.minibatches = 2 must divide each rank's 9 completions of a step",
        ),
        (["--draft.enable", "true", "--rl.ppo_epochs", "0"], "rl.ppo_epochs"),
        (
            ["--draft.enable", "true", "--training.global_batch_size", "16"],
            "training.global_batch_size = 16 with rl.enable = true",
        ),
        (["--draft.enable", "true", "--rl.async_steps", "-1"], "rl.async_steps = -1 is not allowed"),
        (
            ["--draft.enable", "true", "--rl.async_steps", "1", "--rl.behaviour_logprobs", "recompute"],
            "rl.behaviour_logprobs = 'recompute' does not go with rl.async_steps = 1; allowed: rl.behaviour_logprobs = 'engine'",
        ),
        (
            ["--draft.enable", "true", "--rl.async_steps", "2", "--rl.dynamic_sampling", "true"],
            "rl.dynamic_sampling = True does not go with rl.async_steps = 2",
        ),
        (
            [
                "--draft.enable",
                "true",
                "--rl.async_steps",
                "1",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "1",
            ],
            "rl.async_steps = 1 runs with data and context parallelism; parallelism.tensor_parallel_degree = 2 is not allowed",
        ),
    ],
)
def test_rl_config_errors(args, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, ["--rl.enable", "true", *args], world_size=2)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_plan_runs_follows_requires_and_skips_finished_runs(tmp_path):
    from titan_spec.preflight import plan_runs

    def write(name, dump, requires=(), extra=""):
        req = ", ".join(f'"{r}"' for r in requires)
        (tmp_path / name).write_text(f'[job]\ndump_folder = "{tmp_path / dump}"\nrequires = [{req}]\n{extra}')
        return str(tmp_path / name)

    # b reads the HF policy that a exports (job.export_hf): checked against a's architecture.
    write("a.toml", "a", extra='export_hf = "hf"\n')
    write("b.toml", "b", ["a.toml"], f'[model]\nhf_checkpoint = "{tmp_path / "a" / "hf"}"\n')
    c = write("c.toml", "c", ["b.toml"])
    assert [os.path.basename(p) for p in plan_runs(c)] == ["a.toml", "b.toml", "c.toml"]
    # Reading from a required run's dump folder what it does not export is caught up front.
    write("a0.toml", "a0")
    b0 = write("b0.toml", "b0", ["a0.toml"], f'[model]\nhf_checkpoint = "{tmp_path / "a0" / "hf"}"\n')
    with pytest.raises(ConfigError, match="inside the dump folder of .*a0.toml, which runs first but writes no"):
        plan_runs(b0)
    # A finished run (DONE in its dump folder) is not run again, nor what it required.
    os.makedirs(tmp_path / "b")
    (tmp_path / "b" / "DONE").write_text("5\n")
    assert [os.path.basename(p) for p in plan_runs(c)] == ["c.toml"]
    # An input that no earlier run makes must exist now.
    d = write("d.toml", "d", ["a.toml"], '[model]\nhf_checkpoint = "/nonexistent/hf"\n')
    with pytest.raises(ConfigError, match="model.hf_checkpoint '/nonexistent/hf' is not a directory"):
        plan_runs(d)
    write("x.toml", "x", ["y.toml"])
    write("y.toml", "y", ["x.toml"])
    with pytest.raises(ConfigError, match="cycle"):
        plan_runs(str(tmp_path / "x.toml"))


def test_default_chain_is_sft_then_offline_draft_then_rl():
    cfg = load_config(os.path.join(ROOT, "train_configs/debug_cpu.toml"), check_paths=False)
    assert cfg.rl.enable and cfg.draft.enable and cfg.draft.co_train and cfg.speculative.enabled
    draft = load_config(os.path.join(ROOT, "train_configs/debug_cpu_draft.toml"), check_paths=False)
    assert draft.draft.offline and cfg.draft.init_from.startswith(draft.job.dump_folder)
    sft = load_config(os.path.join(ROOT, "train_configs/debug_cpu_sft.toml"))
    assert not sft.draft.enable and cfg.model.hf_checkpoint.startswith(sft.job.dump_folder)
    assert math.isclose(cfg.rl.temperature, 1.0)


def test_one_grpo_step_makes_above_average_completions_likelier():
    """The sign of the whole objective: after one small SGD step on the policy loss, the
    completions with positive advantage gained log-likelihood and the negative ones lost it."""
    model, _ = _tiny(seed=4)
    b = _batch(seed=5)
    meta = doc_metadata_from_positions(b.positions_BL)
    rl = RLConfig(enable=True, temperature=1.0)
    mask = b.labels_BL != IGNORE
    adv = b.values_BL["advantages"]

    def logps():
        with torch.no_grad():
            logits, _ = model(b.input_BL, positions=b.positions_BL, attention_masks=meta)
            return token_logprobs(logits, b.labels_BL, 1.0)

    before = logps()
    logits, taps = model(b.input_BL, positions=b.positions_BL, attention_masks=meta)
    # On-policy: the behaviour log-probs are the model's own.
    out = CoTrainingLoss(None)(ppo_policy_loss(before, adv, rl, mask.sum()), logits, taps, b.labels_BL, mask.sum())
    out.total.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    delta = logps() - before
    assert delta[mask & (adv > 0)].sum() > 0 and delta[mask & (adv < 0)].sum() < 0


def test_generation_shares_partition_the_completions_in_order_and_differ_by_at_most_one():
    # rl/sharing.py: rank k of n generates items[lo:hi) of its data-parallel rank's
    # completions; concatenated in rank order the shares are the list itself, whatever
    # the count (fewer items than ranks included), and no share idles while another holds
    # two more.
    from titan_spec.rl.sharing import share_bounds, share_work

    for count in range(0, 12):
        for n in (1, 2, 3, 4):
            bounds = [share_bounds(count, k, n) for k in range(n)]
            assert [lo for lo, _ in bounds] == [0] + [hi for _, hi in bounds[:-1]] and bounds[-1][1] == count
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1, (count, n, sizes)
    # Alone (no group): one call over every item, as share 0.
    assert share_work(list("abc"), lambda items, k: (items, k), None) == [(list("abc"), 0)]
