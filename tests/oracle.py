"""An independent eager AttnRes model, written straight from DESIGN.md §2.

It shares nothing with graphc's graph, ops or executor: one token row at a time, plain
Python loops, its own AttnRes and attention. Only the weight names (the file format) and
the spec are common. Tests compare graphc's reference executor (and, on the GPU, the
captured step) against it.
"""

from __future__ import annotations

import math

import torch

BF16 = torch.bfloat16


def _bf16(x):
    return x.to(BF16).float()


def attn_res_one_token(incoming, prefix, saved, key_norm, query, gamma, *, nb, has_delta,
                       final, eps, out_eps):
    """Returns (output row, new prefix row). All rows fp32 holding bf16 values."""
    new = _bf16(prefix + incoming) if has_delta else _bf16(incoming)
    D = new.numel()
    if nb == 0:
        mix = new
    else:
        w = key_norm * query
        sources = [saved[b] for b in range(nb)] + [new]
        logits = []
        for v in sources:
            logits.append(torch.dot(v, w) / math.sqrt(float(torch.dot(v, v)) / D + eps))
        logits = torch.stack(logits)
        e = torch.exp(logits - logits.max())
        p = e / e.sum()
        mix = torch.zeros(D)
        for pi, v in zip(p, sources):
            mix = mix + pi * v
    if final:
        mix = _bf16(mix)
    out = _bf16(mix / torch.sqrt((mix * mix).mean() + out_eps) * gamma)
    return out, new


class EagerModel:
    def __init__(self, spec, weights):
        self.spec = spec
        self.w = {k: v.float().cpu() for k, v in weights.items()}
        self.cache = {}     # (layer, slot) -> list of (k [KV, hd], v [KV, hd]) fp32 rows

    def preload(self, layer, slot, keys, values):
        """Pretend ``len(keys)`` tokens are already cached for a sequence."""
        self.cache[(layer, slot)] = [(k.float(), v.float()) for k, v in zip(keys, values)]

    def step(self, tokens, seq_lens, slots):
        return torch.stack([self._token(int(t), int(n), int(s))
                            for t, n, s in zip(tokens, seq_lens, slots)])

    def _token(self, token, seq_len, slot):
        spec, w = self.spec, self.w
        m = spec.model
        attn_res = spec.residual.kind == "attn_res"
        S = spec.residual.block_size if attn_res else 1
        name = "attn_res" if attn_res else "residual"
        saved = {}
        prefix = torch.zeros(m.hidden)

        def residual(node, incoming, *, nb, has_delta, write, final=False, out_eps=m.rms_eps):
            nonlocal prefix
            kn = w.get(f"{node}.key_norm")
            q = w.get(f"{node}.query")
            out, prefix = attn_res_one_token(incoming, prefix, saved, kn, q, w[f"{node}.norm"],
                                             nb=nb, has_delta=has_delta, final=final,
                                             eps=m.rms_eps, out_eps=out_eps)
            if write >= 0:
                saved[write] = prefix
            return out

        def linear(node, x, weight=None):
            return _bf16(w[weight or f"{node}.weight"] @ x)

        incoming = _bf16(w["embed.weight"][token])
        for layer in spec.layers:
            l, at = layer.index, layer.attention
            p = f"L{l:02d}"
            start = attn_res and l % S == 0
            nb = math.ceil(l / S) if attn_res else 0
            h = residual(f"{p}.{name}.attn", incoming, nb=nb, has_delta=l > 0,
                         write=l // S if start else -1)
            qkv = linear(f"{p}.attn.qkv", h)
            H, KV, hd = at.heads, at.kv_heads, at.head_dim
            q = qkv[: H * hd].view(H, hd)
            k_new = qkv[H * hd:(H + KV) * hd].view(KV, hd)
            v_new = qkv[(H + KV) * hd:].view(KV, hd)
            history = self.cache.setdefault((l, slot), [])
            del history[seq_len:]
            history.append((k_new, v_new))
            heads = []
            for head in range(H):
                g = head // (H // KV)
                scores = torch.stack([torch.dot(q[head], kk[g]) for kk, _ in history]) / math.sqrt(hd)
                prob = torch.softmax(scores, 0)
                heads.append(sum(pi * vv[g] for pi, (_, vv) in zip(prob, history)))
            a = linear(f"{p}.attn.o_proj", _bf16(torch.cat(heads)))
            h = residual(f"{p}.{name}.mlp", a, nb=nb + int(start), has_delta=not start, write=-1)
            gu = w[f"{p}.mlp.gate_up.weight"] @ h           # the fp32 projection, not rounded
            inter = layer.mlp.intermediate
            act = _bf16(torch.nn.functional.silu(gu[:inter]) * gu[inter:])
            incoming = linear(f"{p}.mlp.down", act)
        NB = math.ceil(len(spec.layers) / S) if attn_res else 0      # DESIGN §2: blocks of S layers
        out = residual(f"final.{name}", incoming, nb=NB, has_delta=True, write=-1, final=True,
                       out_eps=spec.final_norm_eps)
        return linear("lm_head", out, "embed.weight" if spec.tie_embeddings else None)
