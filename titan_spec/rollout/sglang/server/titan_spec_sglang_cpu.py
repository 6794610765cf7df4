"""EAGLE-3 speculative serving with stock SGLang 0.5.23 on a CPU without AMX.

    import titan_spec_sglang_cpu
    done = titan_spec_sglang_cpu.apply()   # ("op:decode_attention_cpu", ..., "patch:...")

On CPU, SGLang runs EAGLE only with the ``intel_amx`` attention backend, and two things stand
in the way on a machine like ours (AVX-512, no AMX, no CUDA driver):

* ``sglang/srt/arg_groups/overrides.py`` (``_attention_backend_platform_fallbacks``) rewrites
  ``intel_amx`` to ``torch_native`` when the CPU lacks AMX, and ``torch_native`` refuses EAGLE
  (sglang/srt/speculative/draft_utils.py);
* the speculative path and the ``intel_amx`` backend call ``torch.ops.sgl_kernel.*_cpu`` ops
  that only a CPU build of sgl-kernel holds; the sglang-kernel wheel is a CUDA build.

``apply()`` registers pure-PyTorch stand-ins for exactly those ops (only the ones missing) and
lets ``intel_amx`` through. It also lets verification sample: SGLang verifies every CPU request
greedily because its sampling-verify and top-k / top-p renorm kernels are CUDA-only, so
temperature > 0 would silently decode the argmax; the stand-ins fill exactly those names. Nothing else changes: the layers still take their plain-torch path,
because each of them asks ``cpu_has_amx_support()`` itself. The stand-ins follow the op
contracts of upstream sgl-kernel/csrc/cpu/ (speculative_decoding.cpp, decode.cpp, extend.cpp,
kvcache.cpp) with the argument lists SGLang 0.5.23's call sites pass; speculative trees are
supported for ``topk == 1`` (a chain), which is what ``--speculative-eagle-topk 1`` builds.

This module imports torch only (no titan_spec, no sglang at import time): it runs in SGLang's
environment as a top-level module, and in the trainer's tests where sglang is absent.
"""

from __future__ import annotations

import ctypes
import logging

import torch

__all__ = ["apply", "OPS", "applied"]

logger = logging.getLogger(__name__)

# What apply() did, in order; empty until it ran.
applied: tuple[str, ...] = ()
_lib: torch.library.Library | None = None  # keeps the registrations alive


# ---------------------------------------------------------------------------------------------
# Attention. KV buffers are [num_slots, H_kv, D]; req_to_token[r, i] is the slot of token i of
# request r. Scores are computed in float32.


def _attend(q_LqNHd, k_LkKvHd, v_LkKvHd, allowed_LqLk, sm_scale, logit_cap, sinks_N):
    """softmax(q k^T * scale) v for one sequence, with grouped KV heads, a boolean mask of the
    keys each query may see, an optional tanh logit cap and optional per-head sink logits."""
    n_q_heads, n_kv_heads = q_LqNHd.shape[1], k_LkKvHd.shape[1]
    group = n_q_heads // n_kv_heads
    k_NLkHd = k_LkKvHd.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v_NLkHd = v_LkKvHd.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores_NLqLk = torch.matmul(q_LqNHd.float().transpose(0, 1), k_NLkHd.transpose(1, 2)) * sm_scale
    if logit_cap > 0:
        scores_NLqLk = logit_cap * torch.tanh(scores_NLqLk / logit_cap)
    scores_NLqLk = scores_NLqLk.masked_fill(~allowed_LqLk, float("-inf"))
    if sinks_N is not None:
        # A sink is one extra logit per head that takes probability mass and carries no value.
        sink_NLq1 = sinks_N.float().view(-1, 1, 1).expand(-1, scores_NLqLk.shape[1], 1)
        probs_NLqLk = torch.softmax(torch.cat([scores_NLqLk, sink_NLq1], dim=-1), dim=-1)[..., :-1]
    else:
        probs_NLqLk = torch.softmax(scores_NLqLk, dim=-1)
    return torch.matmul(probs_NLqLk, v_NLkHd).transpose(0, 1)  # [Q, H, D]


def _check_attention_options(is_cross_attention):
    if is_cross_attention:
        raise NotImplementedError("titan_spec sglang cpu: cross attention is not supported")


def decode_attention_cpu(
    query, k_cache, v_cache, k_scale, v_scale, output, key, value, loc, attn_logits,
    req_to_token, req_pool_indices, seq_lens, sm_scale, logit_cap,
    is_cross_attention, sliding_window, encoder_lens, sinks,
):  # fmt: skip
    """One new query token per sequence. Writes the new token's key/value into the cache at
    ``loc`` first (intel_amx leaves that write to this kernel), then attends over the
    sequence's first ``seq_lens[i]`` slots. Needed by the intel_amx backend's decode and by the
    draft's multi-step decode (rows of build_draft_decode_metadata_cpu's table)."""
    _check_attention_options(is_cross_attention)
    if key is not None and value is not None and loc is not None:
        k_cache[loc] = key.reshape(-1, *k_cache.shape[1:]).to(k_cache.dtype)
        v_cache[loc] = value.reshape(-1, *v_cache.shape[1:]).to(v_cache.dtype)
    lens = seq_lens.tolist()
    rows = req_pool_indices.tolist()
    for i, (row, n) in enumerate(zip(rows, lens)):
        slots = req_to_token[row, :n].long()
        keep_Lk = torch.ones(n, dtype=torch.bool, device=query.device)
        if sliding_window > 0:
            keep_Lk[: max(n - sliding_window, 0)] = False
        out_1HD = _attend(
            query[i : i + 1],
            k_cache[slots].float() * k_scale,
            v_cache[slots].float() * v_scale,
            keep_Lk.view(1, 1, n),
            sm_scale,
            logit_cap,
            sinks,
        )
        output[i] = out_1HD[0].to(output.dtype)


def extend_attention_cpu(
    q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, k_scale, v_scale,
    req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, max_len_extend,
    sm_scale, logit_cap, is_cross_attention, sliding_window, encoder_lens, sinks, tree_mask, is_causal,
):  # fmt: skip
    """Prefill / target verify / draft extend: sequence b's ``extend_seq_lens[b]`` new tokens
    (rows ``extend_start_loc[b]:`` of q/k/v_extend) attend to its cached prefix (read through
    req_to_token) and, causally, to each other. Needed by the intel_amx backend for every
    forward that is not a one-token decode."""
    _check_attention_options(is_cross_attention)
    if tree_mask is not None:
        # intel_amx passes a mask only for trees (topk > 1); a chain is plain causal attention.
        raise NotImplementedError("titan_spec sglang cpu: tree attention masks (topk > 1) are not supported")
    for b, (row, n, ext, start) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(), extend_start_loc.tolist())
    ):
        prefix = n - ext
        slots = req_to_token[row, :n].long()
        if k_extend is not None and v_extend is not None:
            k_LkKvHd = torch.cat([k_buffer[slots[:prefix]].float() * k_scale, k_extend[start : start + ext].float()])
            v_LkKvHd = torch.cat([v_buffer[slots[:prefix]].float() * v_scale, v_extend[start : start + ext].float()])
        else:  # a KV-shared layer: its new keys are already in the cache
            k_LkKvHd = k_buffer[slots].float() * k_scale
            v_LkKvHd = v_buffer[slots].float() * v_scale
        q_pos_Q = torch.arange(prefix, n, device=q_extend.device).view(-1, 1)
        k_pos_K = torch.arange(n, device=q_extend.device).view(1, -1)
        allowed_LqLk = (k_pos_K <= q_pos_Q) if is_causal else torch.ones(ext, n, dtype=torch.bool)
        if sliding_window > 0:
            allowed_LqLk &= q_pos_Q - k_pos_K < sliding_window
        out_LqNHd = _attend(
            q_extend[start : start + ext], k_LkKvHd, v_LkKvHd, allowed_LqLk.unsqueeze(0), sm_scale, logit_cap, sinks
        )
        o_extend[start : start + ext] = out_LqNHd.to(o_extend.dtype)


# ---------------------------------------------------------------------------------------------
# KV slot bookkeeping for the draft and verify steps.


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[rpi[i], start[i]:end[i]] = the next end[i]-start[i] entries of out_cache_loc:
    records the slots allocated for each request's draft/verify tokens (spec decode alloc)."""
    flat = req_to_token.view(-1)
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        flat[row * pool_len + start : row * pool_len + end] = out_cache_loc[offset : offset + n].to(flat.dtype)
        offset += n


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """The inverse gather: out_cache_loc = concat_i req_to_token[rpi[i], start[i]:end[i]]. Used
    to collect the verify window's slots and, after verify, the accepted front of each window."""
    flat = req_to_token.reshape(-1)
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        out_cache_loc[offset : offset + n] = flat[row * pool_len + start : row * pool_len + end].to(out_cache_loc.dtype)
        offset += n


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
):
    """out_cache_loc[i*topk*num_steps : ...] = the topk*num_steps slots reserved for request i's
    draft tokens, i.e. req_to_token[rpi[i], seq_lens[i]:][: topk*num_steps]."""
    width = topk * num_steps
    flat = req_to_token.reshape(-1)
    out_rows = out_cache_loc.view(-1, width)
    for i, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_rows[i] = flat[row * pool_len + n : row * pool_len + n + width].to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len):
    """A [num_seqs*topk, pool_len] slot table for the draft's multi-step decode: row b*topk+k is
    request b's committed prefix followed by candidate k's draft slots (laid out at
    seq_len + k*num_steps by assign_draft_cache_locs_contiguous). Entries past
    seq_len + num_steps are left undefined, as upstream does."""
    table = torch.zeros(len(req_pool_indices) * topk, pool_len, dtype=req_to_token.dtype, device=req_to_token.device)
    for b, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        src = req_to_token[row]
        for k in range(topk):
            table[b * topk + k, :n] = src[:n]
            table[b * topk + k, n : n + num_steps] = src[n + k * num_steps : n + (k + 1) * num_steps]
    return table


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the accepted tokens' slots: out_cache_loc[accept_index] without the -1 (rejected)
    entries, in order. Feeds move_kv_cache, which packs accepted KV to the window's front."""
    index = accept_index.reshape(-1)
    picked = out_cache_loc[index[index > -1].long()]
    accept_out_cache_loc[: picked.numel()] = picked.to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[i] = the last accepted token of request i (accept_lens counts the bonus),
    the token the next draft round starts from."""
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    picked = accept_tokens.reshape(-1)[rows * accept_stride + accept_lens.long() - 1]
    bonus_tokens.copy_(picked.to(bonus_tokens.dtype))


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (given by its base address and its slot size in bytes), copy slot
    src_loc[j] to slot tgt_loc[j]: move_kv_cache packs the accepted tokens' KV after verify.
    The buffers come as raw addresses, so each is viewed as [slots, bytes]; the gather runs
    before the scatter, which keeps overlapping moves safe, as upstream."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    n_slots = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.view(torch.int64).tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (n_slots * stride)).from_address(ptr)
        slot_bytes = torch.frombuffer(raw, dtype=torch.uint8).view(n_slots, stride)
        slot_bytes[tgt] = slot_bytes[src]


# ---------------------------------------------------------------------------------------------
# Draft tree construction and greedy verification.


def build_tree_kernel_efficient_cpu(
    parent_list, selected_index, verified_seq_len, tree_mask, positions,
    retrive_index, retrive_next_token, retrive_next_sibling, topk, depth, draft_token_num, tree_mask_mode,
):  # fmt: skip
    """Turn the draft's picks into what verify consumes: per draft token its position, the
    retrieval links (flat index, first child, next sibling; the caller pre-fills -1) and the
    attention mask over the draft tokens (each sees the root, its ancestors and itself).
    Node t >= 1 is the pick selected_index[t-1]; its parent is the node whose pick produced
    parent_list[selected_index[t-1] // topk] (the root when that quotient is 0). Mask
    layouts: QLEN_ONLY (1) is [bs, n, n]; FULL_MASK (0) gives each request an
    [n, seq_len + n] block whose prefix columns stay as the caller filled them."""
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError(f"titan_spec sglang cpu: tree mask mode {tree_mask_mode}")
    n = draft_token_num
    mask_offset = 0
    for b, seq_len in enumerate(verified_seq_len.tolist()):
        sel = selected_index[b].tolist()
        par = parent_list[b].tolist()
        parent = [-1] * n  # -1: the root, or a node whose parent was not among the picks
        for t in range(1, n):
            slot = sel[t - 1] // topk
            if slot == 0:
                parent[t] = 0
            elif par[slot] in sel:
                parent[t] = sel.index(par[slot]) + 1
        retrive_index[b] = b * n + torch.arange(n)
        # Children are linked in ascending order: walk the nodes backwards, prepending each.
        for t in range(n - 1, 0, -1):
            p = parent[t]
            if p < 0:
                continue
            if retrive_next_token[b, p] != -1:
                retrive_next_sibling[b, t] = retrive_next_token[b, p]
            retrive_next_token[b, p] = t
        if tree_mask_mode == 1:
            node_mask = tree_mask.view(-1, n, n)[b]
        else:
            block = tree_mask[mask_offset : mask_offset + n * (seq_len + n)].view(n, seq_len + n)
            node_mask = block[:, seq_len:]
            mask_offset += n * (seq_len + n)
        node_mask.fill_(False)
        node_mask[:, 0] = True
        for t in range(n):
            node, d = t, 0
            while node > 0:
                node_mask[t, node] = True
                node, d = parent[node], d + 1
            positions[b * n + t] = seq_len + d


def verify_tree_greedy_cpu(
    predicts, accept_index, accept_token_num, candidates,
    retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
):  # fmt: skip
    """Greedy acceptance: walk each request's tree from the root, at each level taking the child
    whose draft token equals the target's argmax at the current node; stop when none does.
    Writes predicts (the target's token at every accepted node, bonus included), accept_index
    (flat indices of the accepted nodes, left as the caller's -1 past them) and
    accept_token_num (accepted drafts, bonus excluded)."""
    target_flat = target_predict.reshape(-1).tolist()
    for b in range(candidates.shape[0]):
        cand = candidates[b].tolist()
        index = retrive_index[b].tolist()
        first_child = retrive_next_token[b].tolist()
        sibling = retrive_next_sibling[b].tolist()
        last = index[0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, accept_index.shape[1]):
            node = first_child[node]
            while node != -1 and cand[node] != target_flat[last]:
                node = sibling[node]
            if node == -1:
                break
            predicts[last] = target_flat[last]
            accepted += 1
            accept_index[b, accepted] = index[node]
            last = index[node]
        accept_token_num[b] = accepted
        predicts[last] = target_flat[last]


# ---------------------------------------------------------------------------------------------
# Sampled verification. SGLang's eagle_sample takes its sampling path only where
# tree_speculative_sampling_target_only and the top-k / top-p renorm kernels exist; on CPU they
# resolve to None (sglang/kernels/ops/speculative/verify_sampling.py, sampling/renorm.py) and
# _verify_uses_greedy sends every CPU request to argmax verification. These stand-ins follow
# the CUDA kernel (sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh) and SGLang's
# own torch sampler (top_k_top_p_min_p_sampling_from_probs_torch).


def tree_speculative_sampling_target_only_cpu(
    predicts, accept_index, accept_token_num, candidates,
    retrive_index, retrive_next_token, retrive_next_sibling,
    uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
    threshold_single=1.0, threshold_acc=1.0, deterministic=True,
):  # fmt: skip
    """Rejection sampling of a draft tree against target probabilities only (the draft is
    taken as deterministic). At each level a child t is accepted when coin < p_acc / threshold_acc
    (p_acc sums the target mass of the siblings tried so far) or p(t) >= threshold_single;
    a rejected child's target mass is written to draft_probs so the final token is drawn from
    relu(target - draft) at the last accepted node, by the inverse CDF of that request's final
    coin. With both thresholds 1 this is exact sampling from the target. Writes predicts,
    accept_index, accept_token_num and draft_probs, like the kernel."""
    del deterministic  # one thread per request here: always deterministic
    threshold_acc = max(float(threshold_acc), 1e-9)
    n_spec = accept_index.shape[1]
    for b in range(candidates.shape[0]):
        cand = candidates[b].tolist()
        index = retrive_index[b].tolist()
        first_child = retrive_next_token[b].tolist()
        sibling = retrive_next_sibling[b].tolist()
        coins = uniform_samples[b].tolist()
        coin, prob_acc, row = coins[0], 0.0, 0
        last = index[0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, n_spec):
            node = first_child[node]
            while node != -1:
                t = cand[node]
                p = float(target_probs[b, row, t])
                prob_acc += p
                if p > 0 and (coin < prob_acc / threshold_acc or p >= threshold_single):
                    prob_acc, row, coin = 0.0, node, coins[node]
                    predicts[last] = t
                    accepted += 1
                    accept_index[b, accepted] = index[node]
                    last = index[node]
                    break
                draft_probs[b, row, t] = target_probs[b, row, t]
                node = sibling[node]
            if node == -1:
                break
        accept_token_num[b] = accepted
        residual_V = target_probs[b, row].float()
        if accepted != n_spec - 1:  # the bonus row has no draft mass to remove
            residual_V = (residual_V - draft_probs[b, row].float()).clamp_min(0)
        cdf_V = residual_V.cumsum(0)
        u = float(uniform_samples_for_final_sampling[b]) * float(cdf_V[-1])
        token = int(torch.searchsorted(cdf_V, torch.tensor([u]), right=True))
        if token >= cdf_V.numel():  # u at the top of the mass: the last token that has any
            nonzero = residual_V.nonzero()
            token = int(nonzero[-1]) if nonzero.numel() else cdf_V.numel() - 1
        predicts[last] = token


def _sorted_keep(probs_RV, keep_fn):
    """Zero the probabilities keep_fn drops in descending order, renormalize each row."""
    sorted_RV, order_RV = probs_RV.sort(dim=-1, descending=True)
    sorted_RV = sorted_RV.masked_fill(~keep_fn(sorted_RV), 0.0)
    kept_RV = torch.zeros_like(probs_RV).scatter_(-1, order_RV, sorted_RV)
    return kept_RV / kept_RV.sum(dim=-1, keepdim=True)


def top_k_renorm_prob_cpu(probs_RV, top_ks_R):
    """Keep each row's top_k most likely tokens (top_k >= vocab keeps all) and renormalize."""
    ranks_V = torch.arange(probs_RV.shape[-1], device=probs_RV.device)
    top_ks_R1 = torch.as_tensor(top_ks_R, device=probs_RV.device).view(-1, 1)
    return _sorted_keep(probs_RV, lambda s: ranks_V.view(1, -1) < top_ks_R1)


def top_p_renorm_prob_cpu(probs_RV, top_ps_R):
    """Keep the smallest top set whose mass reaches top_p (the rule of SGLang's torch sampler:
    a token goes when the mass before it exceeds top_p) and renormalize."""
    top_ps_R1 = torch.as_tensor(top_ps_R, device=probs_RV.device, dtype=probs_RV.dtype).view(-1, 1)
    return _sorted_keep(probs_RV, lambda s: (s.cumsum(-1) - s) <= top_ps_R1)


def _enable_sampled_verify() -> list[str]:
    """Let EAGLE verify sample on CPU: fill the CPU-less kernels in eagle_utils with the
    stand-ins above and drop is_cpu from its greedy-only predicate (HIP, XPU and all-greedy
    batches keep their rule)."""
    try:
        from sglang.srt.speculative import eagle_utils
    except ImportError:
        return []
    if getattr(eagle_utils._verify_uses_greedy, "_titan_spec", False):
        return []
    done = []
    for name, fn in (
        ("tree_speculative_sampling_target_only", tree_speculative_sampling_target_only_cpu),
        ("top_k_renorm_prob", top_k_renorm_prob_cpu),
        ("top_p_renorm_prob", top_p_renorm_prob_cpu),
    ):
        if getattr(eagle_utils, name) is None:
            setattr(eagle_utils, name, fn)
            done.append(f"sglang.srt.speculative.eagle_utils.{name}")
    original = eagle_utils._verify_uses_greedy

    def _verify_uses_greedy(*, is_cpu, **kwargs):
        return original(is_cpu=False, **kwargs)

    _verify_uses_greedy._titan_spec = True
    eagle_utils._verify_uses_greedy = _verify_uses_greedy
    return done + ["sglang.srt.speculative.eagle_utils._verify_uses_greedy"]


# ---------------------------------------------------------------------------------------------
# Registration.

# name -> (schema, stand-in). The schemas take the arguments SGLang 0.5.23's call sites pass
# (sglang/srt/layers/attention/intel_amx_backend.py, sgl_kernel/speculative.py,
# sgl_kernel/kvcacheio.py); "(a!)" marks what an op writes.
OPS = {
    "decode_attention_cpu": (
        "(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, float v_scale, Tensor(c!) output, "
        "Tensor? key, Tensor? value, Tensor? loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attention, "
        "int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()",
        decode_attention_cpu,
    ),
    "extend_attention_cpu": (
        "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
        "Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int? max_len_extend, float sm_scale, "
        "float logit_cap, bool is_cross_attention, int sliding_window, Tensor? encoder_lens, Tensor? sinks, "
        "Tensor? tree_mask, bool is_causal) -> ()",
        extend_attention_cpu,
    ),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()",
        assign_req_to_token_pool_cpu,
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()",
        assign_extend_cache_locs_cpu,
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, Tensor(a!) out_cache_loc, int pool_len, "
        "int topk, int num_steps) -> ()",
        assign_draft_cache_locs_contiguous_cpu,
    ),
    "build_draft_decode_metadata_cpu": (
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, int num_steps, "
        "int pool_len) -> Tensor",
        build_draft_decode_metadata_cpu,
    ),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()",
        fill_accept_out_cache_loc_cpu,
    ),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()",
        fill_bonus_tokens_cpu,
    ),
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        copy_all_layer_kv_cache_cpu,
    ),
    "build_tree_kernel_efficient_cpu": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, Tensor(a!) tree_mask, "
        "Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
        "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()",
        build_tree_kernel_efficient_cpu,
    ),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, Tensor candidates, "
        "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
        "Tensor target_predict) -> ()",
        verify_tree_greedy_cpu,
    ),
}


def _op_exists(name: str) -> bool:
    return f"sgl_kernel::{name}" in torch._C._dispatch_get_all_op_names()


def _register_ops() -> list[str]:
    global _lib
    try:
        # sgl_kernel's own extension must load first: it opens the "sgl_kernel" namespace, and
        # a CPU build would bring the real ops, which then are not replaced.
        import sgl_kernel  # noqa: F401
    except Exception as e:  # absent (trainer venv) or unloadable: the stand-ins define the ops
        logger.debug("sgl_kernel not importable (%s); defining its CPU ops here", e)
    registered = []
    for name, (schema, fn) in OPS.items():
        if _op_exists(name):
            continue
        if _lib is None:
            _lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        _lib.define(name + schema)
        _lib.impl(name, fn, "CPU")
        registered.append(name)
    return registered


def _lift_amx_fallback() -> list[str]:
    """Keep ``--attention-backend intel_amx`` on a CPU without AMX. SGLang's post-process pass
    rewrites it to torch_native, which has no EAGLE support; the intel_amx backend itself
    needs only the ops registered here, and every layer still checks AMX on its own."""
    try:
        from sglang.srt.arg_groups import attention_hook
    except ImportError:
        return []
    original = attention_hook._attention_backend_platform_fallbacks
    if getattr(original, "_titan_spec", False):
        return []

    def _attention_backend_platform_fallbacks(view):
        if view.attention_backend == "intel_amx" and view.device == "cpu":
            return {}
        return original(view)

    _attention_backend_platform_fallbacks._titan_spec = True
    _attention_backend_platform_fallbacks.__qualname__ = original.__qualname__
    # attention_hook imported the pass by name, so its binding is the one to replace.
    attention_hook._attention_backend_platform_fallbacks = _attention_backend_platform_fallbacks
    return ["sglang.srt.arg_groups.attention_hook._attention_backend_platform_fallbacks"]


def apply() -> tuple[str, ...]:
    """Register the missing ``sgl_kernel::*_cpu`` ops and lift the no-AMX fallback, once per
    process. Returns what was done (``op:<name>``, ``patch:<target>``); a second call returns
    the first call's result."""
    global applied
    if applied:
        return applied
    patches = _lift_amx_fallback() + _enable_sampled_verify()
    done = [f"op:{n}" for n in _register_ops()] + [f"patch:{p}" for p in patches]
    applied = tuple(done) or ("nothing",)
    return applied
