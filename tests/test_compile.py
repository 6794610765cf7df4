"""torch.compile of the tapped target, per block as torchtitan applies it: whole-graph
blocks (no graph break), the same logits and taps as eager, and no recompilation when
the packed document layout changes from batch to batch."""

import torch
import torch._dynamo

import titan_spec  # noqa: F401
from titan_spec.models.registry import build_target_config, flavor_arch


def _batch(doc_lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(n) for n in doc_lens])[None]
    return torch.randint(0, vocab, pos.shape, generator=g), pos


def test_compiled_blocks_match_eager_and_do_not_recompile_per_layout():
    torch.manual_seed(0)
    arch = flavor_arch("qwen3", "tiny")
    model = build_target_config(arch, tap_layer_ids=(1, 3, 4), max_seq_len=256).build()
    model.init_weights(buffer_device=None)
    eager = {k: v.clone() for k, v in model.state_dict().items()}
    ref = build_target_config(arch, tap_layer_ids=(1, 3, 4), max_seq_len=256).build()
    ref.load_state_dict(eager)

    torch._dynamo.reset()
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend="aot_eager", fullgraph=True))

    layouts = [(40, 24, 64), (7, 1, 50, 70), (128,), (3, 5, 8, 13, 21, 34, 44)]
    compiles = []
    for i, lens in enumerate(layouts):
        tok, pos = _batch(lens, arch.vocab_size, i)
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        logits, taps = model(tok, pos, model.get_attention_masks(pos))
        logits.sum().backward()
        compiles.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        with torch.no_grad():
            ref_logits, ref_taps = ref(tok, pos, ref.get_attention_masks(pos))
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        for a, b in zip(taps.hidden, ref_taps.hidden):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # First layout compiles, the second may generalize to dynamic shapes; after that
    # a new document layout must reuse the graphs.
    assert compiles[2] == 0 and compiles[3] == 0, compiles
