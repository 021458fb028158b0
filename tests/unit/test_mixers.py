"""The sequence mixers of the hybrid models (models/common/mamba2.py, gated_deltanet.py, the gated attention in
attention.py) and their cores (ssd.py, delta_rule.py, short_conv.py): chunked scan == the token recurrence, each
module == its transformers counterpart with the same weights, packed documents == each document alone, prefill +
decode steps == the full forward, and torch.compile == eager. Tiny shapes, float32 on CPU. Tolerance: 1e-5 (unless a
comment says otherwise) on the largest absolute difference, scaled by the reference's largest magnitude when above 1
(float32 keeps ~7 digits of the value, whatever its size)."""
from __future__ import annotations

import pytest
import torch

from models.common.attention import GatedAttention
from models.common.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from models.common.gated_deltanet import GatedDeltaNet, conv_hf_order
from models.common.hf_utils import half_to_interleaved
from models.common.mamba2 import Mamba2Mixer, reorder_packed
from models.common.rope import precompute_rope_cache
from models.common.short_conv import causal_conv1d
from models.common.ssd import ssd_chunk_scan, ssd_recurrent

TOL = 1e-5
DIM = 32
# Two rows: three documents of uneven lengths (one shorter than the conv window) and one document.
DOCS = torch.tensor([[0] * 9 + [1] * 2 + [2] * 13, [5] * 24])


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    scale = max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol:.0e} x {scale:.3g}"


def mamba2(**kw) -> Mamba2Mixer:
    kw = dict(dim=DIM, n_heads=4, head_dim=8, state_size=6, n_groups=2, chunk_size=8) | kw
    return randomize(Mamba2Mixer(**kw))


def deltanet(**kw) -> GatedDeltaNet:
    kw = dict(dim=DIM, n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=6, chunk_size=8) | kw
    return randomize(GatedDeltaNet(**kw))


def randomize(m: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """init_weights, then projections of unit gain (outputs of order 1, so absolute tolerances mean something) and
    every norm weight and conv bias moved off its constant start so the test sees them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        m.init_weights(0.02)
        for lin in m.modules():
            if isinstance(lin, torch.nn.Linear):
                lin.weight.normal_(0, lin.in_features ** -0.5)
        m.norm.weight.add_(0.1 * torch.randn_like(m.norm.weight))
        if m.conv1d.bias is not None:
            m.conv1d.bias.normal_()
    return m


def grads(m: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in m.named_parameters()}
    out["input"] = x.grad.clone()
    m.zero_grad()
    x.grad = None
    return out


def cot(t: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A fixed random cotangent: the gradients of sum(out * cot) test every output element."""
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))


# ---- cores: chunked == recurrent -------------------------------------------------------------------------------------

def ssd_inputs(seed=0, b=2, t=24, h=4, p=3, g=2, n=5):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(b, t, h, p), dt=r(b, t, h), A=-torch.rand(h, generator=gen) * 3, B=r(b, t, g, n),
                C=r(b, t, g, n), D=r(h), dt_bias=r(h), initial_states=r(b, h, p, n))


@pytest.mark.parametrize("docs", [False, True])
def test_ssd_chunked_equals_recurrence(docs):
    inp = {k: v.requires_grad_() for k, v in ssd_inputs().items()}
    kw = dict(seq_idx=DOCS if docs else None, dt_softplus=True, dt_limit=(0.05, 2.0), return_final_states=True)
    results = []
    for fn, extra in ((ssd_chunk_scan, dict(chunk_size=8)), (ssd_chunk_scan, dict(chunk_size=5)), (ssd_recurrent, {})):
        y, final = fn(**inp, **kw, **extra)
        (y * cot(y)).sum().add((final * cot(final)).sum()).backward()
        results.append((y, final, {k: v.grad.clone() for k, v in inp.items()}))
        for v in inp.values():
            v.grad = None
    ref_y, ref_final, ref_grads = results[-1]
    for y, final, g in results[:-1]:  # chunk 8 divides T = 24; chunk 5 pads the last chunk
        close(y, ref_y)
        close(final, ref_final)
        for k in g:
            close(g[k], ref_grads[k])


def gdn_inputs(seed=0, b=2, t=24, h=2, hv=4, dk=6, dv=5):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(b, t, h, dk), k=r(b, t, h, dk), v=r(b, t, hv, dv), g=-torch.rand(b, t, hv, generator=gen) * 2,
                beta=torch.rand(b, t, hv, generator=gen), initial_state=r(b, hv, dk, dv))


@pytest.mark.parametrize("docs", [False, True])
def test_gated_delta_rule_chunked_equals_recurrence(docs):
    inp = {k: v.requires_grad_() for k, v in gdn_inputs().items()}
    kw = dict(seq_idx=DOCS if docs else None, use_qk_l2norm_in_kernel=True, output_final_state=True)
    results = []
    for fn, extra in ((chunk_gated_delta_rule, dict(chunk_size=8)), (chunk_gated_delta_rule, dict(chunk_size=5)),
                      (recurrent_gated_delta_rule, {})):
        o, final = fn(**inp, **kw, **extra)
        (o * cot(o)).sum().add((final * cot(final)).sum()).backward()
        results.append((o, final, {k: v.grad.clone() for k, v in inp.items()}))
        for v in inp.values():
            v.grad = None
    ref_o, ref_final, ref_grads = results[-1]
    for o, final, g in results[:-1]:
        close(o, ref_o)
        close(final, ref_final)
        for k in g:
            close(g[k], ref_grads[k])


def test_causal_conv1d_documents_and_state():
    """The tap-by-tap document path equals the dense conv on one document, and a state continues a sequence."""
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 24, 7, generator=gen), torch.randn(7, 4, generator=gen), torch.randn(7, generator=gen)
    dense, state = causal_conv1d(x, w, bias, output_final_state=True)
    tapped, tapped_state = causal_conv1d(x, w, bias, seq_idx=torch.zeros(2, 24, dtype=torch.long),
                                         output_final_state=True)
    close(tapped, dense)
    close(tapped_state, state)
    head, mid = causal_conv1d(x[:, :10], w, bias, output_final_state=True)
    tail, _ = causal_conv1d(x[:, 10:], w, bias, initial_state=mid)
    close(torch.cat([head, tail], dim=1), dense)



def test_mamba2_half_of_the_groups_is_a_mixer():
    """What tensor parallel relies on (parallelize/nemotron_h.py): a contiguous half of the group-major in_proj rows,
    of conv1d's channels, of the per-head scalars and of the norm weight, with the matching half of out_proj's
    columns, is a mixer of half the groups; the two halves' outputs add up to the whole mixer's (documents included)."""
    m = mamba2()
    x = torch.randn(2, 24, DIM)
    with torch.no_grad():
        parts = []
        for k in range(2):
            half = Mamba2Mixer(DIM, n_heads=2, head_dim=8, state_size=6, n_groups=1, chunk_size=8)
            half.load_state_dict({n: t.chunk(2, dim=1 if n == "out_proj.weight" else 0)[k]
                                  for n, t in m.state_dict().items()})
            parts.append(half(x, doc_ids=DOCS))
        close(parts[0] + parts[1], m(x, doc_ids=DOCS))



def test_gated_deltanet_half_of_the_key_heads_is_a_mixer():
    """What tensor parallel relies on (parallelize/qwen3_next.py): a contiguous half of in_proj_qkvz's, in_proj_ba's
    and conv1d's rows (key-head-major), of dt_bias and A_log, with the matching half of out_proj's columns and the
    whole norm weight (shared by the heads), is a mixer of half the key heads and their value heads; the two halves'
    outputs add up to the whole mixer's (documents included). Fails with conv1d in transformers' [q | k | v] order."""
    m = deltanet()
    x = torch.randn(2, 24, DIM)
    with torch.no_grad():
        parts = []
        for k in range(2):
            half = GatedDeltaNet(DIM, n_k_heads=1, n_v_heads=2, head_k_dim=8, head_v_dim=6, chunk_size=8)
            half.load_state_dict({n: t if n == "norm.weight" else t.chunk(2, dim=1 if n == "out_proj.weight" else 0)[k]
                                  for n, t in m.state_dict().items()})
            parts.append(half(x, doc_ids=DOCS))
        close(parts[0] + parts[1], m(x, doc_ids=DOCS))


@pytest.mark.parametrize("n_groups,count", [(2, 2), (1, 2), (2, 4)])
def test_mamba2_head_parts_are_the_mixer(n_groups, count):
    """What context parallel relies on (parallelize/cp_recurrent.py): head_parts' `count` parts (whole groups; or
    shares of one group's heads, each with a copy of its B and C), each run by mix_part and put side by side, give
    the mixer's output and every gradient (documents included). float64: the same sums in another order."""
    m = mamba2(n_groups=n_groups).double()
    x = torch.randn(2, 24, DIM, dtype=torch.float64, requires_grad=True)
    (m(x, doc_ids=DOCS) * cot(x)).sum().backward()
    ref = grads(m, x)

    def run_parts(mixer, xbc, dt, doc_ids):
        parts = mixer.head_parts(xbc, dt, count)
        return torch.cat([mixer.mix_part(parts[i], doc_ids, i, count) for i in range(count)], dim=-1)

    m.sequence_fn = run_parts
    out = m(x, doc_ids=DOCS)
    (out * cot(x)).sum().backward()
    m.sequence_fn = None
    close(out, m(x, doc_ids=DOCS).detach(), tol=1e-12)
    for name, g in grads(m, x).items():
        close(g, ref[name], tol=1e-12)
    with pytest.raises(ValueError, match="parallelism.cp must divide"):
        m.head_parts(torch.empty(0), torch.empty(0), 3)  # 3 parts of 4 heads: refused before reading them

@pytest.mark.parametrize("n_k_heads,count", [(2, 2), (4, 2), (4, 4)])
def test_gated_deltanet_head_parts_are_the_mixer(n_k_heads, count):
    """What context parallel relies on (parallelize/cp_recurrent.py): head_parts' `count` parts of whole key heads
    (each with its value heads), each run by mix_part and put side by side, give the mixer's output and every
    gradient (documents included). float64: the same sums in another order."""
    m = deltanet(n_k_heads=n_k_heads, n_v_heads=2 * n_k_heads).double()
    x = torch.randn(2, 24, DIM, dtype=torch.float64, requires_grad=True)
    (m(x, doc_ids=DOCS) * cot(x)).sum().backward()
    ref = grads(m, x)

    def run_parts(mixer, qkv, ba, doc_ids):
        parts = mixer.head_parts(qkv, ba, count)
        assert parts.shape[:4] == (count, 2, 24, n_k_heads // count)
        return torch.cat([mixer.mix_part(parts[i], doc_ids, i, count) for i in range(count)], dim=-1)

    m.sequence_fn = run_parts
    out = m(x, doc_ids=DOCS)
    (out * cot(x)).sum().backward()
    m.sequence_fn = None
    close(out, m(x, doc_ids=DOCS).detach(), tol=1e-12)
    for name, g in grads(m, x).items():
        close(g, ref[name], tol=1e-12)
    with pytest.raises(ValueError, match="parallelism.cp must divide the key heads per TP rank"):
        m.head_parts(torch.empty(0), torch.empty(0), 3)  # 3 parts of 2 or 4 key heads: refused before reading them

# ---- modules == transformers -----------------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def hf_state(m: Mamba2Mixer) -> dict[str, torch.Tensor]:
    """Our mixer's state dict in transformers' row order (in_proj and conv1d are group-major here, part-major there;
    the names are the same)."""
    return reorder_packed(m.state_dict(), m.n_heads, m.head_dim, m.state_size, m.n_groups, to_hf=True)


def test_mamba2_matches_nemotron_h():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHConfig, NemotronHMamba2Mixer

    cfg = NemotronHConfig(hidden_size=DIM, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2,
                          conv_kernel=4, chunk_size=8, use_conv_bias=True, use_bias=False, time_step_min=0.3,
                          layer_norm_epsilon=1e-5)
    hf = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    ours = mamba2(dt_limit=(0.3, float("inf")), norm_eps=1e-5, conv_bias=True, bias=False)
    hf.load_state_dict(hf_state(ours))  # the same names; an adapter renames the prefix and reorders in_proj, conv1d
    x = torch.randn(2, 21, DIM)
    with torch.no_grad():
        close(ours(x), hf(x))


def test_mamba2_matches_transformers_mamba2():
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Config, Mamba2Mixer as HFMamba2Mixer

    cfg = Mamba2Config(hidden_size=DIM // 2, expand=2, num_heads=4, head_dim=8, state_size=6, n_groups=2,
                       conv_kernel=3, chunk_size=8, use_conv_bias=False, use_bias=True, time_step_limit=(0.0, 1.5),
                       layer_norm_epsilon=1e-6)
    hf = HFMamba2Mixer(cfg, layer_idx=0).eval()
    ours = mamba2(dim=DIM // 2, conv_kernel=3, dt_limit=(0.0, 1.5), conv_bias=False, bias=True, norm_eps=1e-6)
    with torch.no_grad():
        ours.in_proj.bias.normal_()
        ours.out_proj.bias.normal_()
    hf.load_state_dict(hf_state(ours))
    x = torch.randn(2, 19, DIM // 2)
    with torch.no_grad():
        close(ours(x), hf(x))


def test_gated_deltanet_matches_qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextConfig, Qwen3NextGatedDeltaNet

    cfg = Qwen3NextConfig(hidden_size=DIM, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                          linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    hf = Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()
    ours = deltanet()
    state = ours.state_dict()  # conv1d's channels key-head-major here, [q | k | v] there (the HF adapter permutes)
    order = conv_hf_order(ours.n_k_heads, ours.head_k_dim, ours.n_v_heads, ours.head_v_dim)
    hf.load_state_dict(state | {"conv1d.weight": state["conv1d.weight"][torch.argsort(order)]})
    x = torch.randn(2, 21, DIM)  # HF's torch path chunks by 64: one padded chunk; ours: three chunks of 8
    with torch.no_grad():
        close(ours(x), hf(x))


def test_gated_attention_matches_qwen3_next():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention, Qwen3NextConfig, Qwen3NextRotaryEmbedding)

    n_heads, n_kv, hd, seq = 4, 2, 16, 12
    cfg = Qwen3NextConfig(hidden_size=DIM, num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=hd,
                          rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                           "rope_type": "default"}, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3NextAttention(cfg, layer_idx=3).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GatedAttention(DIM, n_heads, n_kv, hd, norm_eps=1e-6, rotary_dim=hd // 4)
    rd = hd // 4

    def rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:  # per head, HF's half-split rotary rows interleaved
        w = w.view(heads, hd, -1).clone()
        w[:, :rd] = half_to_interleaved(w[:, :rd].reshape(heads * rd, -1), heads).view(heads, rd, -1)
        return w.view(heads * hd, -1)

    q, gate = hf.q_proj.weight.view(n_heads, 2, hd, DIM).unbind(1)
    wq = torch.stack([rope_rows(q.reshape(-1, DIM), n_heads).view(n_heads, hd, DIM), gate], dim=1)
    norm_w = lambda w: rope_rows(w[None, :, None], 1).flatten()  # noqa: E731  (one head's channels)
    ours.load_state_dict({"wq.weight": wq.reshape(-1, DIM), "wk.weight": rope_rows(hf.k_proj.weight, n_kv),
                          "wv.weight": hf.v_proj.weight, "wo.weight": hf.o_proj.weight,
                          "q_norm.weight": norm_w(hf.q_norm.weight), "k_norm.weight": norm_w(hf.k_norm.weight)})
    x = torch.randn(2, seq, DIM)
    pos = torch.arange(seq)[None].expand(2, -1)
    cos_sin = Qwen3NextRotaryEmbedding(cfg)(x, pos)
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = hf(x, cos_sin, causal)
        close(ours(x, precompute_rope_cache(rd, seq, 10000.0)), ref)


# ---- packed documents, decoding, compile -----------------------------------------------------------------------------

MIXERS = {"mamba2": mamba2, "deltanet": deltanet}


@pytest.mark.parametrize("name", MIXERS)
def test_packed_documents_equal_each_document_alone(name):
    """A row packing three documents (doc_ids) gives each document's outputs and the same gradients as running the
    documents one by one; the second row (one document) equals the plain forward."""
    m = MIXERS[name]()
    x = torch.randn(2, 24, DIM, requires_grad=True)
    out = m(x, doc_ids=DOCS)
    (out * cot(out)).sum().backward()
    packed = grads(m, x)

    bounds = [0, 9, 11, 24]
    alone = torch.cat([m(x[:1, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    alone = torch.cat([alone, m(x[1:])], dim=0)
    (alone * cot(out)).sum().backward()
    separate = grads(m, x)
    close(out, alone)
    for k in packed:
        close(packed[k], separate[k])


@pytest.mark.parametrize("name", MIXERS)
def test_prefill_and_decode_steps_equal_the_full_forward(name):
    m = MIXERS[name]()
    x = torch.randn(2, 20, DIM)
    with torch.no_grad():
        full = m(x)
        pre, state = m(x[:, :11], return_state=True)  # 11: one whole chunk of 8 and a partial one
        outs = [pre]
        for i in range(11, 15):
            y, state = m.step(x[:, i:i + 1], state)
            outs.append(y)
        rest, state = m(x[:, 15:], state=state, return_state=True)  # a chunked continuation from a state
        close(torch.cat(outs + [rest], dim=1), full)
        _, end = m(x, return_state=True)
        close(state.conv, end.conv)
        close(state.recurrent, end.recurrent)
        # A zero state is the same as none.
        close(m(x, state=m.init_state(2)), full)


@pytest.mark.parametrize("name", MIXERS)
def test_documents_then_decode(name):
    """The state a packed prefill returns is its last document's alone: left padding (document 0) stays out of a
    prompt's state."""
    m = MIXERS[name]()
    x = torch.randn(1, 14, DIM)
    docs = torch.tensor([[0] * 5 + [1] * 9])
    with torch.no_grad():
        _, packed = m(x[:, :13], doc_ids=docs[:, :13], return_state=True)
        _, alone = m(x[:, 5:13], return_state=True)
        close(packed.conv, alone.conv)
        close(packed.recurrent, alone.recurrent)
        close(m.step(x[:, 13:], packed)[0], m(x[:, 5:])[:, -1:])


@pytest.mark.parametrize("name", MIXERS)
def test_compiled_forward_equals_eager(name):
    """The chunked forward (documents and the returned state included) and its backward compile as one graph
    (fullgraph). aot_eager, as the other compile tests here: Inductor's CPU compile of these graphs takes minutes on
    two cores (it passed when tried, with the same tolerance); tests/gpu/test_mixers_gpu.py runs Inductor on a GPU."""
    torch._dynamo.reset()
    m = MIXERS[name]()
    x = torch.randn(2, 24, DIM, requires_grad=True)
    ref, ref_state = m(x, doc_ids=DOCS, return_state=True)
    (ref * cot(ref)).sum().backward()
    eager = grads(m, x)
    out, state = torch.compile(m, fullgraph=True, backend="aot_eager")(x, doc_ids=DOCS, return_state=True)
    (out * cot(out)).sum().backward()
    compiled = grads(m, x)
    close(out, ref)
    close(state.recurrent, ref_state.recurrent)
    for k in eager:
        close(compiled[k], eager[k])


@pytest.mark.parametrize("name", MIXERS)
def test_meta_build_and_init_weights(name):
    """Built on meta like every model, materialised with to_empty + init_weights: A = exp(A_log) and
    dt = softplus(dt_bias) land in their init ranges, and the forward is finite."""
    ctor = {"mamba2": Mamba2Mixer, "deltanet": GatedDeltaNet}[name]
    kw = (dict(dim=DIM, n_heads=4, head_dim=8, state_size=6, n_groups=2) if name == "mamba2"
          else dict(dim=DIM, n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=6))
    with torch.device("meta"):
        m = ctor(**kw)
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_weights(0.01)
    A, dt = m.A_log.exp(), torch.nn.functional.softplus(m.dt_bias)
    assert ((A >= m.a_init_range[0] - 1e-4) & (A <= m.a_init_range[1] + 1e-4)).all()
    assert ((dt >= 1e-3 - 1e-6) & (dt <= 1e-1 + 1e-6)).all()
    assert torch.isfinite(m(torch.randn(2, 10, DIM))).all()


def test_fla_kernel_selection_on_cpu():
    """model.mixer_kernel on a machine without a GPU: auto and torch keep the PyTorch scans; fla is one clear error.
    Documents become fla's varlen offsets over the rows laid end to end."""
    from models.common.backends import wants_fla
    from models.common.fla_kernels import cu_seqlens

    cpu = torch.device("cpu")
    assert wants_fla("auto", cpu) == (False, "fla's Triton kernels need a CUDA GPU")
    assert wants_fla("torch", cpu) == (False, None)
    with pytest.raises(ValueError, match=r"model.mixer_kernel='fla': fla's Triton kernels need a CUDA GPU"):
        wants_fla("fla", cpu)
    docs = torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 4, 4]])
    assert cu_seqlens(docs).tolist() == [0, 2, 5, 8, 10]
    assert cu_seqlens(torch.zeros(3, 4, dtype=torch.long)).tolist() == [0, 4, 8, 12]
    # Computed once for all layers of a step (each computation is a host sync), again for a changed or new tensor.
    from models.common.fla_kernels import _Varlen

    varlen = _Varlen()
    first = varlen.offsets(docs)
    assert varlen.offsets(docs) is first and first.tolist() == [0, 2, 5, 8, 10]
    docs[1, 3:] = 3  # in place: the version counter moves
    assert varlen.offsets(docs).tolist() == [0, 2, 5, 10]
    assert varlen.offsets(torch.zeros(2, 5, dtype=torch.long)).tolist() == [0, 5, 10]
