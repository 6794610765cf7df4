"""The exported draft, run the way SGLang runs it, gives the project's draft logits.

Shape legend: T = positions, Ht = target hidden, H = draft hidden, N = query heads,
Kv = kv heads, Hd = head dim, Vd = draft vocab, V = target vocab.

The reference forward below (``sglang_eagle3_forward``) is written for this test from SGLang
0.5.23's ``LlamaForCausalLMEagle3`` (sglang/srt/models/llama_eagle3.py in the sglang-0.5.23
wheel from PyPI, with the pieces it reuses: LlamaAttention / LlamaMLP in models/llama.py,
RMSNorm.forward_native in layers/layernorm.py, SiluAndMul in layers/activation.py). It reads
only the exported ``config.json`` and ``model.safetensors`` (never the project's importer or
modules) and follows what that source does:

  * weight names: ``load_weights`` renames the legacy ``midlayer`` to ``layers.0`` and maps a
    file name to ``model.<name>`` (``lm_head`` at the top); ``q_proj`` / ``k_proj`` /
    ``v_proj`` are loaded as the q, k, v shards of one ``qkv_proj`` whose output is split
    [q, kv, kv]; ``gate_proj`` / ``up_proj`` as shards 0, 1 of ``gate_up_proj`` (SiluAndMul:
    silu(first half) * second half); ``d2t`` becomes ``hot_token_id = d2t + arange``; ``t2d``
    is skipped. A name the loader does not know is silently ignored there, so the test asserts
    the exact name set and shapes.
  * config: head_dim from the config; the optional ``norm_before_fc``, ``fc_norm`` /
    ``use_aux_norm`` and ``norm_output`` switches must be off (the test asserts the export
    does not set them); the number of aux states is len(eagle_aux_hidden_state_layer_ids) = 3.
  * ``LlamaModel.forward``: the aux hidden states (the three target taps, concatenated in tap
    order) go through ``fc`` because their width (3 Ht) differs from the embedding's (H).
  * the input layer (``LlamaDecoderLayer`` override, layer 0): residual = the fc output;
    cat([input_layernorm(embeds), hidden_norm(hidden)]) -- embeds FIRST -- feeds a qkv_proj
    with 2H inputs; neox (rotate-half) rotary at rope_theta on q and k; causal attention with
    scale Hd^-0.5, query head i reading kv head i // (N / Kv); o_proj; then the fused
    add-RMSNorm ``post_attention_layernorm(attn, residual)`` (residual += attn; normalize);
    the MLP on the normalized sum.
  * the final ``norm(mlp_out, residual)``: residual += mlp_out; the logits come from
    lm_head(norm(residual)) over the draft vocab, and the hidden state handed to the next draft
    step is the un-normalized sum (norm_output off).

The project's side is the rollout engine's KV-cached draft forward (CachedDraft.extend) over the
in-memory draft that was exported, and the same over a draft re-imported by load_draft_into.
The reference runs in float64 on the float32 file; the project in float32.

Bugs this catches (each tried as a local mutation of the exporter, see red, revert): k and v
exported swapped (same shape, and symmetric with the importer); the 2H input columns of q/k/v
in the wrong order (hidden first); input_layernorm and hidden_norm swapped; gate and up swapped;
d2t written as absolute ids. Not covered: the embedding / input-id shift of SGLang's EAGLE
worker (outside this model file) and SGLang's chain-step tree attention.
"""

import json
import math
import os

import torch
from safetensors.torch import load_file

import titan_spec  # noqa: F401
from titan_spec.models.draft.eagle3.model import DraftArch, Eagle3Draft
from titan_spec.models.draft.eagle3.io import load_draft_into, save_draft
from titan_spec.models.draft.eagle3.proposer import CachedDraft

# target_hidden != hidden (fc must run), head_dim != hidden / heads and rope_theta != 1e4
# (both must come from the config); GQA with 2 query heads per kv head.
ARCH = DraftArch(
    hidden=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=12,
    intermediate=40,
    target_hidden=24,
    vocab_size=50,
    draft_vocab_size=20,
    rope_theta=5e5,
    norm_eps=1e-6,
    max_seq_len=128,
    tap_layer_ids=(1, 3, 4),
)
T = 7  # positions 0..T-1 (rotary at non-zero angles from position 1 on)

SGLANG_NAMES = {
    # file name -> the SGLang 0.5.23 parameter it loads into (llama_eagle3.py load_weights)
    "fc.weight": "model.fc.weight",
    "midlayer.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
    "midlayer.hidden_norm.weight": "model.layers.0.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight": "model.layers.0.self_attn.qkv_proj.weight[q]",
    "midlayer.self_attn.k_proj.weight": "model.layers.0.self_attn.qkv_proj.weight[k]",
    "midlayer.self_attn.v_proj.weight": "model.layers.0.self_attn.qkv_proj.weight[v]",
    "midlayer.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight": "model.layers.0.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight": "model.layers.0.mlp.gate_up_proj.weight[0]",
    "midlayer.mlp.up_proj.weight": "model.layers.0.mlp.gate_up_proj.weight[1]",
    "midlayer.mlp.down_proj.weight": "model.layers.0.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "hot_token_id (d2t + arange)",
    "t2d": "(skipped)",
}


def _random_draft(seed: int = 0) -> Eagle3Draft:
    """Weights large enough that attention is far from uniform, norms far from ones (so a
    swapped norm shows), and a scattered draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    d = Eagle3Draft(ARCH)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]) * 1.5)
        ids = torch.sort(torch.randperm(ARCH.vocab_size, generator=g)[: ARCH.draft_vocab_size]).values
        t2d = torch.zeros(ARCH.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        d.set_vocab_mapping(ids - torch.arange(ARCH.draft_vocab_size), t2d)
    return d.eval()


# --- the SGLang reference, from the exported files only -----------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _neox_rotary(x_TNHd, pos_T, theta):
    hd = x_TNHd.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang_TF = pos_T.double()[:, None] * inv_freq[None]
    cos, sin = ang_TF.cos()[:, None], ang_TF.sin()[:, None]  # [T, 1, Hd/2]
    x1, x2 = x_TNHd[..., : hd // 2], x_TNHd[..., hd // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def sglang_eagle3_forward(path: str, taps_T3Ht: torch.Tensor, embeds_TH: torch.Tensor, pos_T: torch.Tensor):
    """(logits_TVd, next-step hidden_TH, hot_token_id_Vd) of one draft step over T positions
    (causal), float64, from ``path``/config.json and ``path``/model.safetensors."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    w = {
        k: (v.double() if v.is_floating_point() else v)
        for k, v in load_file(os.path.join(path, "model.safetensors")).items()
    }
    H, N, Kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Hd = cfg.get("head_dim", H // N)
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000)  # SGLang's default
    Tn = embeds_TH.shape[0]

    # Stacked projections, as SGLang's loader builds them.
    w_qkv = torch.cat(
        [
            w["midlayer.self_attn.q_proj.weight"],
            w["midlayer.self_attn.k_proj.weight"],
            w["midlayer.self_attn.v_proj.weight"],
        ],
        dim=0,
    )
    w_gate_up = torch.cat([w["midlayer.mlp.gate_proj.weight"], w["midlayer.mlp.up_proj.weight"]], dim=0)

    hidden_TH = taps_T3Ht.double().flatten(1) @ w["fc.weight"].T  # width 3 Ht != H: fc applies
    residual_TH = hidden_TH
    e_TH = _rms(embeds_TH.double(), w["midlayer.input_layernorm.weight"], eps)
    h_TH = _rms(hidden_TH, w["midlayer.hidden_norm.weight"], eps)
    qkv = torch.cat([e_TH, h_TH], dim=-1) @ w_qkv.T
    q, k, v = qkv.split([N * Hd, Kv * Hd, Kv * Hd], dim=-1)
    q = _neox_rotary(q.view(Tn, N, Hd), pos_T, theta)
    k = _neox_rotary(k.view(Tn, Kv, Hd), pos_T, theta)
    v = v.view(Tn, Kv, Hd)
    kv_of_head = torch.arange(N) // (N // Kv)
    scores_NTT = torch.einsum("tnd,snd->nts", q, k[:, kv_of_head]) * Hd**-0.5
    causal_TT = pos_T[None, :] <= pos_T[:, None]
    attn_TNHd = torch.einsum(
        "nts,snd->tnd", scores_NTT.masked_fill(~causal_TT, -math.inf).softmax(-1), v[:, kv_of_head]
    )
    o_TH = attn_TNHd.reshape(Tn, N * Hd) @ w["midlayer.self_attn.o_proj.weight"].T
    residual_TH = o_TH + residual_TH  # fused add-RMSNorm
    gate_up = _rms(residual_TH, w["midlayer.post_attention_layernorm.weight"], eps) @ w_gate_up.T
    gate, up = gate_up.chunk(2, dim=-1)
    mlp_TH = (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    residual_TH = mlp_TH + residual_TH  # the final fused add-RMSNorm
    logits_TVd = _rms(residual_TH, w["norm.weight"], eps) @ w["lm_head.weight"].T
    hot_Vd = w["d2t"] + torch.arange(w["d2t"].shape[0])
    return logits_TVd, residual_TH, hot_Vd


# --- the project's forward ----------------------------------------------------------------


def project_forward(draft: Eagle3Draft, taps_T3Ht, emb_VH, tokens_T):
    """Logits and next-step hidden at each of the T positions from the engine's cached draft
    forward: row b of one batched extend from position 0 holds the first b+1 positions, so its
    output is position b (causal over the ones before it). (An extend from a later start
    attends to the cache slots before it, which the engine filled in earlier rounds.)"""
    cd = CachedDraft(draft, lambda tok: emb_VH[tok])
    n = tokens_T.shape[0]
    cd.new_cache(n, n)
    h_BH, logits_BVd = cd.extend(
        taps_T3Ht.expand(n, -1, -1, -1),
        tokens_T.expand(n, -1),
        torch.zeros(n, dtype=torch.long),
        torch.arange(1, n + 1),
        n_slots=n,
    )
    return logits_BVd, h_BH


def test_exported_draft_runs_in_sglangs_eagle3_layout_like_the_project(tmp_path):
    g = torch.Generator().manual_seed(1)
    draft = _random_draft()
    path = str(tmp_path / "draft")
    save_draft(draft, path)

    # The file holds exactly the names SGLang's loader consumes, at SGLang's shapes.
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert sorted(tensors) == sorted(SGLANG_NAMES)
    a = ARCH
    want_shapes = {
        "fc.weight": (a.hidden, 3 * a.target_hidden),
        "midlayer.self_attn.q_proj.weight": (a.n_heads * a.head_dim, 2 * a.hidden),
        "midlayer.self_attn.k_proj.weight": (a.n_kv_heads * a.head_dim, 2 * a.hidden),
        "midlayer.self_attn.v_proj.weight": (a.n_kv_heads * a.head_dim, 2 * a.hidden),
        "midlayer.self_attn.o_proj.weight": (a.hidden, a.n_heads * a.head_dim),
        "midlayer.mlp.gate_proj.weight": (a.intermediate, a.hidden),
        "midlayer.mlp.up_proj.weight": (a.intermediate, a.hidden),
        "midlayer.mlp.down_proj.weight": (a.hidden, a.intermediate),
        "lm_head.weight": (a.draft_vocab_size, a.hidden),
        "d2t": (a.draft_vocab_size,),
        "t2d": (a.vocab_size,),
    }
    for k, shape in want_shapes.items():
        assert tuple(tensors[k].shape) == shape, k
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["head_dim"] == a.head_dim
    assert cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
    assert cfg["num_hidden_layers"] == 1 and len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    # Switches that would add norms or change the hidden state SGLang hands on; all off.
    for key in ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output", "num_aux_hidden_states", "bias"):
        assert not cfg.get(key) and not cfg["eagle_config"].get(key), key

    emb_VH = torch.randn(
        a.vocab_size, a.hidden, generator=g
    )  # the target's embedding (SGLang loads it from the target)
    taps_T3Ht = torch.randn(T, 3, a.target_hidden, generator=g)
    tokens_T = torch.randint(0, a.vocab_size, (T,), generator=g)
    pos_T = torch.arange(T)
    ref_logits, ref_h, ref_hot = sglang_eagle3_forward(path, taps_T3Ht, emb_VH[tokens_T], pos_T)
    assert ref_logits.abs().max() > 1.0 and ref_logits.std(0).mean() > 0.3  # varied, not degenerate

    # The hot-token map: SGLang's target id of each draft id.
    assert torch.equal(ref_hot, draft.draft_to_target_ids())

    reimported = Eagle3Draft(ARCH)
    load_draft_into(reimported, path)
    for which, d in (("exported draft", draft), ("re-imported draft", reimported.eval())):
        with torch.no_grad():
            logits, h = project_forward(d, taps_T3Ht, emb_VH, tokens_T)
        # tolerance: the same weights in fp32 against SGLang's forward in fp64: fp32 rounding of a few GEMMs
        torch.testing.assert_close(
            logits.double(), ref_logits, rtol=1e-5, atol=2e-5, msg=lambda m: f"{which} logits: {m}"
        )
        # tolerance: the same as the logits' (the hidden state of the same fp32 forward)
        torch.testing.assert_close(h.double(), ref_h, rtol=1e-5, atol=2e-5, msg=lambda m: f"{which} hidden: {m}")
        assert torch.equal(d.draft_to_target_ids(), ref_hot)
