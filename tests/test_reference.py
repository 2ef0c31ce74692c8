"""The reference executor (graph -> schedule -> plan -> torch ops) against the independent
eager model of tests/oracle.py, over successive decode steps with a growing cache."""

import pytest
import torch

from graphc.graph import build_graph, weight_shapes
from graphc.plan import Plan
from graphc.reference import reference_step
from graphc.schedule import build_schedule
from graphc.spec import load_spec, parse_spec
from graphc.weights import Weights
from oracle import EagerModel

SPECS = "layer_specs"


def compare(got, want):
    """Whole-model logits: the many bf16 rounding points of two different summation orders
    flip a few last bits, which a random model carries forward; a logic error (a wrong slot,
    a missed add) gives a relative error near 1."""
    got, want = got.float(), want.float()
    assert not torch.isnan(got).any()
    rel = (got - want).norm() / want.norm()
    assert rel < 2e-2, rel
    top2 = want.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])
    return int(decided.sum())


def build(spec, batch, seed=0):
    schedule = build_schedule(build_graph(spec))
    weights = Weights.random(weight_shapes(schedule.graph), seed=seed)
    return Plan(schedule, batch, weights), weights


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("residual", ["attn_res", "plain"])
def test_executor_matches_eager_model_over_four_steps(batch, residual):
    spec = load_spec(f"{SPECS}/tiny.yaml")
    if residual == "plain":
        spec = spec.with_residual("plain")
    check_against_oracle(spec, batch)


# tiny.yaml edited where its own values would hide a wiring error: blocks that do not divide
# the layers, one layer per block (4 saved blocks), the lm_head tied to the embedding, and a
# final-norm eps unlike rms_eps (equal in every shipped spec, so a swap could pass unseen).
SPEC_EDITS = {
    "block_size_3": ("block_size: 2", "block_size: 3"),
    "block_size_1": ("block_size: 2", "block_size: 1"),
    "tied_lm_head": ("tied: false", "tied: true"),
    "final_norm_eps": ("final_norm:\n  eps: 1.0e-6", "final_norm:\n  eps: 3.0"),
}


@pytest.mark.parametrize("edit", SPEC_EDITS)
def test_executor_matches_eager_model_on_other_specs(edit):
    old, new = SPEC_EDITS[edit]
    text = open(f"{SPECS}/tiny.yaml").read()
    assert old in text
    check_against_oracle(parse_spec(text.replace(old, new), f"{edit}.yaml"), batch=3)


def check_against_oracle(spec, batch):
    """Four decode steps of the reference executor against the eager model, rows starting at
    different cached lengths in shuffled slots."""
    plan, weights = build(spec, batch, seed=batch)
    oracle = EagerModel(spec, weights.tensors)
    gen = torch.Generator().manual_seed(batch)
    # Rows start at different lengths: the first tokens of each sequence are already cached.
    lens = torch.randint(0, 6, (batch,), generator=gen, dtype=torch.int32)
    slots = torch.randperm(batch, generator=gen).to(torch.int32)
    for layer in spec.layers:
        kv = plan.view(f"L{layer.index:02d}.kv", batch)
        at = layer.attention
        for row in range(batch):
            n, s = int(lens[row]), int(slots[row])
            hist = (torch.randn(n, 2, at.kv_heads, at.head_dim, generator=gen)).to(torch.bfloat16)
            kv[s, :, :, :n] = hist.permute(1, 2, 0, 3)
            oracle.preload(layer.index, s, hist[:, 0], hist[:, 1])
    decided = 0
    for step in range(4):
        tokens = torch.randint(0, spec.model.vocab, (batch,), generator=gen)
        seq_lens = lens + step
        got = reference_step(plan, tokens, seq_lens, slots).clone()
        want = oracle.step(tokens, seq_lens, slots)
        decided += compare(got, want)
    assert decided > 0, "no row's top two logits were apart: the argmax check compared nothing"


def test_reference_is_deterministic_and_uses_the_cache():
    spec = load_spec(f"{SPECS}/tiny.yaml")
    plan, _ = build(spec, 2)
    tokens = torch.tensor([5, 9])
    first = reference_step(plan, tokens, torch.tensor([0, 0], dtype=torch.int32)).clone()
    again = reference_step(plan, tokens, torch.tensor([0, 0], dtype=torch.int32)).clone()
    assert torch.equal(first, again)
    # Cache other tokens at position 0; the same tokens at position 1 then attend over them too.
    reference_step(plan, torch.tensor([11, 12]), torch.tensor([0, 0], dtype=torch.int32))
    later = reference_step(plan, tokens, torch.tensor([1, 1], dtype=torch.int32)).clone()
    assert not torch.equal(first, later)


@pytest.mark.parametrize("nb", [0, 1, 3])
@pytest.mark.parametrize("has_delta", [True, False])
@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("eps, out_eps", [(1e-6, 1e-5), (0.5, 0.02)])
def test_attn_res_reference_matches_eager_definition(nb, has_delta, final, eps, out_eps):
    """One op, teacher-forced: the torch reference of DESIGN §2 against the oracle's
    token-at-a-time definition, on inputs with a wide spread of source magnitudes; and with
    eps values that matter beside the data (a swapped or dropped eps shows)."""
    from graphc.ops.attn_res_math import attn_res_reference
    from oracle import attn_res_one_token

    T, D, NB = 5, 1024, 4
    gen = torch.Generator().manual_seed(nb * 4 + has_delta * 2 + final)
    bf = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(torch.bfloat16)
    scales = torch.rand(1, NB, 1, generator=gen) * 9.9 + 0.1
    blocks = (torch.randn(T, NB, D, generator=gen) * scales).to(torch.bfloat16)
    prefix, delta = bf(T, D, scale=3.0), bf(T, D)
    key_norm, query, gamma = bf(D, scale=0.1) + 1, bf(D, scale=0.1), bf(D, scale=0.1) + 1
    write = 1 if nb < 2 else -1
    want_prefix = prefix.clone()
    got_prefix, got_blocks = prefix.clone(), blocks.clone()
    out = attn_res_reference(delta, got_prefix, got_blocks, key_norm, query, gamma, nb=nb,
                             has_delta=has_delta, write=write, final=final, eps=eps, out_eps=out_eps)
    for t in range(T):
        saved = [blocks[t, b].float() for b in range(NB)]
        o, new = attn_res_one_token(delta[t].float(), want_prefix[t].float(), saved,
                                    key_norm.float(), query.float(), gamma.float(), nb=nb,
                                    has_delta=has_delta, final=final, eps=eps, out_eps=out_eps)
        assert torch.equal(got_prefix[t].float(), new)
        if write >= 0:
            assert torch.equal(got_blocks[t, write].float(), new)
        rel = (out[t].float() - o).norm() / o.norm()
        assert rel < 1e-2
        assert (out[t].float() == o).float().mean() > 0.95
    untouched = [b for b in range(NB) if b != write]
    assert torch.equal(got_blocks[:, untouched], blocks[:, untouched])


def test_write_output_is_exact_for_every_bf16_value():
    """Torch implementations end with write_output (a kernel, never a memcpy node, so a PDL
    edge after them stays programmatic when captured): it must store exactly what a copy
    stores, -0, infinities and NaN included, and round fp32 as .to(bfloat16) does."""
    import torch

    from graphc.ops.base import write_output

    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    every = bits.view(torch.bfloat16)
    out = torch.empty_like(every)
    write_output(out, every)
    same = (out.view(torch.int16) == bits) | (torch.isnan(out) & torch.isnan(every))
    assert same.all()
    wide = torch.randn(4096, dtype=torch.float32) * 1e3
    write_output(out[:4096], wide)
    assert torch.equal(out[:4096], wide.to(torch.bfloat16))
