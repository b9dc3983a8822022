"""Sinkhorn attention as a Hugging Face ``transformers`` backend, on tiny random local models."""

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import future_gradient  # noqa: E402

import sinkformer  # noqa: E402
from sinkformer.integrations import huggingface as hf  # noqa: E402
from sinkformer.integrations.huggingface import (  # noqa: E402
    register,
    self_attention_mask,
    sinkhorn_attention_forward,
)

HF_PAGE = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
WORDS = "[PAD] [UNK] [CLS] [SEP] [MASK] a an the film movie great awful dull gripping beautiful and far too long".split()


def bert_config(**kwargs):
    """A tiny BERT; initializer_range 0.2 gives peaked attention (SoftMax far from doubly stochastic)."""
    base = dict(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, initializer_range=0.2, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    return transformers.BertConfig(**{**base, **kwargs})


def vit_config():
    return transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, initializer_range=0.2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def padded_batch():
    """Two sentences of 7 tokens; the first one ends with 2 padding tokens."""
    ids = torch.randint(5, len(WORDS), (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:] = 0
    ids[0, 5:] = 0
    return ids, mask


def column_error(weights, n_real):
    """max |column sum - 1| over the square block of real tokens of one sequence's ``(H, n, n)`` weights."""
    block = weights[:, :n_real, :n_real]
    return (block.sum(-2) - 1).abs().max().item()


class Layer(torch.nn.Module):
    """Stands for an encoder self-attention layer of a transformers model."""

    is_causal = False


# --- the attention function on its own -----------------------------------------------------------


def test_bool_padding_mask_means_padding_as_keys_and_queries():
    q, k, v = torch.randn(3, 2, 2, 6, 8).unbind(0)
    pad = torch.tensor([[True, True, False, False, False, False], [False] * 6])  # left padding
    hf_mask = (~pad)[:, None, None, :].expand(2, 1, 6, 6)  # what sdpa_mask builds: keys only
    out, weights = sinkhorn_attention_forward(Layer(), q, k, v, hf_mask, n_iters=7, output_attentions=True)
    ref, ref_w = sinkformer.attention(q, k, v, n_iters=7, key_padding_mask=pad, query_padding_mask=pad,
                                      return_weights=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(weights, ref_w, rtol=0, atol=1e-6)
    assert weights[0, :, :2].abs().max() == 0 and weights[0, :, :, :2].abs().max() == 0


@pytest.mark.parametrize("excluded", [float("-inf"), torch.finfo(torch.float32).min, -1e9, -1e4])
def test_float_mask_reads_like_bool_mask(excluded):
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    keep[0, ..., 3:] = False
    float_mask = torch.zeros(2, 1, 5, 5).masked_fill(~keep, excluded)
    assert torch.equal(self_attention_mask(float_mask) == float("-inf"), ~self_attention_mask(keep))
    q, k, v = torch.randn(3, 2, 2, 5, 4).unbind(0)
    out_f, _ = sinkhorn_attention_forward(Layer(), q, k, v, float_mask, n_iters=5)
    out_b, _ = sinkhorn_attention_forward(Layer(), q, k, v, keep, n_iters=5)
    torch.testing.assert_close(out_f, out_b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("excluded", [float("-inf"), torch.finfo(torch.float32).min, -1e9, False])
def test_a_causal_mask_in_a_bidirectional_layer_is_refused(excluded):
    """Issue 23.1: a 4-D causal mask (a user's, or HF's with finfo.min) reaching a layer that runs
    bidirectional Sinkhorn would leak: refused, eagerly and compiled."""
    keep = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    mask = keep if excluded is False else torch.zeros(2, 1, 5, 5).masked_fill(~keep, excluded)
    q, k, v = torch.randn(3, 2, 2, 5, 4).unbind(0)
    with pytest.raises(ValueError, match="leak from the future"):
        sinkhorn_attention_forward(Layer(), q, k, v, mask, n_iters=3)
    if excluded != torch.finfo(torch.float32).min:  # compiled once, with what transformers writes
        return
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: sinkhorn_attention_forward(Layer(), q, k, v, mask, n_iters=3)[0],
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="leak from the future"):
        compiled(q, k, v)


def test_scaling_and_position_bias_are_the_models():
    """T5-style: no 1/sqrt(d) scaling, a learned bias added to the scores."""
    q, k, v = torch.randn(3, 1, 2, 4, 8).unbind(0)
    bias = torch.randn(1, 2, 4, 4)
    out, _ = sinkhorn_attention_forward(Layer(), q, k, v, None, n_iters=3, scaling=1.0, position_bias=bias)
    ref = sinkformer.attention(q, k, v, n_iters=3, scale=1.0, attn_mask=bias)
    torch.testing.assert_close(out, ref.transpose(1, 2))


def test_grouped_query_attention_repeats_key_value_heads():
    layer = Layer()
    layer.num_key_value_groups = 2
    q = torch.randn(1, 4, 5, 8)
    k, v = torch.randn(2, 1, 2, 5, 8).unbind(0)
    out, _ = sinkhorn_attention_forward(layer, q, k, v, None, n_iters=5)
    ref = sinkformer.attention(q, k[:, [0, 0, 1, 1]], v[:, [0, 0, 1, 1]], n_iters=5)
    torch.testing.assert_close(out, ref.transpose(1, 2))


def test_unsupported_option_raises():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="does not support softcap"):
        sinkhorn_attention_forward(Layer(), q, q, q, None, softcap=30.0)


def test_register_validates_its_arguments():
    with pytest.raises(ValueError, match="n_iters must be an int >= 1, got 0"):
        register(n_iters=0)
    with pytest.raises(ValueError, match="'sdpa' is already an attention implementation"):
        register(name="sdpa")
    with pytest.raises(ValueError, match="non-empty string"):
        register(name="")
    with pytest.raises(TypeError, match="name must be a str, got int 5"):
        register(name=5)
    assert register(n_iters=3, name="sinkhorn_test") == "sinkhorn_test"
    assert register(n_iters=4, name="sinkhorn_test") == "sinkhorn_test"  # re-registering our own name is fine
    assert transformers.AttentionInterface()["sinkhorn_test"].keywords == {"n_iters": 4, "causal": False}
    assert register(n_iters=3, name="sinkhorn_test", causal=True) == "sinkhorn_test"
    assert transformers.AttentionInterface()["sinkhorn_test"].keywords == {"n_iters": 3, "causal": True}
    with pytest.raises(TypeError, match="causal must be a bool, got str 'yes'"):
        register(causal="yes")


# --- whole models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_one_iteration_equals_the_models_eager_attention(kind):
    if kind == "bert":
        model = transformers.AutoModel.from_config(bert_config(), attn_implementation="eager").eval()
        inputs = dict(zip(("input_ids", "attention_mask"), padded_batch()))
        real = inputs["attention_mask"].bool()
    else:
        model = transformers.AutoModel.from_config(vit_config(), attn_implementation="eager").eval()
        inputs = dict(pixel_values=torch.randn(2, 3, 8, 8))
        real = torch.ones(2, 5, dtype=torch.bool)
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
        model.set_attn_implementation(register(n_iters=1, name="sinkhorn_1"))
        ours = model(**inputs, output_attentions=True)
    # padding tokens carry no mass: their own outputs differ from eager SoftMax, the real tokens' agree
    torch.testing.assert_close(ours.last_hidden_state[real], eager.last_hidden_state[real], rtol=0, atol=1e-5)
    for a, b in zip(ours.attentions, eager.attentions):
        torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_more_iterations_give_doubly_stochastic_attentions(kind):
    torch.manual_seed(1)
    if kind == "bert":
        config, (ids, mask) = bert_config(), padded_batch()
        inputs, n_real = dict(input_ids=ids, attention_mask=mask), mask.sum(-1).tolist()
    else:
        config, inputs, n_real = vit_config(), dict(pixel_values=torch.randn(2, 3, 8, 8)), [5, 5]
    model = transformers.AutoModel.from_config(config, attn_implementation=register(n_iters=1, name="sinkhorn_1"))
    with torch.no_grad():
        softmax = model(**inputs, output_attentions=True).attentions
        model.set_attn_implementation(register(n_iters=51, name="sinkhorn_51"))
        sinkhorn = model(**inputs, output_attentions=True).attentions
    for layer_sm, layer_sk in zip(softmax, sinkhorn):
        for b, n in enumerate(n_real):
            assert column_error(layer_sm[b], n) > 0.5  # SoftMax attention is not doubly stochastic here
            assert column_error(layer_sk[b], n) < 1e-4
            torch.testing.assert_close(layer_sk[b, :, :n, :n].sum(-1), torch.ones(4, n))
            assert layer_sk[b, :, n:].abs().sum() == 0 and layer_sk[b, :, :, n:].abs().sum() == 0  # padding


def test_padding_carries_no_mass(monkeypatch):
    """A padded sentence's real tokens get exactly the outputs of the same sentence alone."""
    model = transformers.AutoModel.from_config(bert_config(), attn_implementation=register()).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        alone = model(input_ids=ids[:1, :5]).last_hidden_state
        padded = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(padded[0, :5], alone[0], rtol=0, atol=1e-5)
        # masking padded keys only (padded queries still in the column sums) would fail this test
        monkeypatch.setattr(hf, "self_attention_mask", lambda attention_mask, position_bias=None: attention_mask)
        keys_only = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (keys_only[0, :5] - alone[0]).abs().max() > 1e-2


def test_causal_and_cross_attention_keep_softmax_and_say_so():
    config = dict(is_decoder=True, add_cross_attention=True)  # from_config sets the backend on the config
    sdpa = transformers.AutoModelForCausalLM.from_config(bert_config(**config), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(bert_config(**config), attn_implementation=register())
    ours.load_state_dict(sdpa.state_dict())
    ids, mask = padded_batch()
    memory = torch.randn(2, 3, 32)
    with torch.no_grad():
        expected = sdpa(input_ids=ids, attention_mask=mask, encoder_hidden_states=memory).logits
        with pytest.warns(UserWarning, match="keep SoftMax") as record:
            got = ours.eval()(input_ids=ids, attention_mask=mask, encoder_hidden_states=memory).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    warned = {str(w.message).split(":")[0] for w in record}
    assert {"BertSelfAttention", "BertCrossAttention"} <= warned


def test_encoders_do_not_warn(recwarn):
    model = transformers.AutoModel.from_config(bert_config(), attn_implementation=register())
    model(*padded_batch())
    assert not [w for w in recwarn if "keep SoftMax" in str(w.message)]


def test_save_pretrained_and_reload_as_sinkformer(tmp_path):
    model = transformers.BertForSequenceClassification(bert_config(num_labels=3)).eval()
    model.save_pretrained(tmp_path)
    model.set_attn_implementation(register())
    ids, mask = padded_batch()
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="sinkhorn")
    softmax = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        got = reloaded(input_ids=ids, attention_mask=mask).logits
        baseline = softmax(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert (baseline - expected).abs().max() > 1e-3  # the reloaded model really runs Sinkhorn


def test_one_training_step_lowers_the_loss():
    model = transformers.AutoModelForSequenceClassification.from_config(
        bert_config(num_labels=2), attn_implementation=register(n_iters=5)
    ).train()
    ids, mask = padded_batch()
    labels = torch.tensor([0, 1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grad = model.bert.encoder.layer[0].attention.self.query.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().max() > 0  # gradients reach the attention scores
    optimizer.step()
    after = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert after.item() < loss.item()


# --- causal Sinkformers: GPT-2 ------------------------------------------------------------------------


def gpt2(n_iters, *, causal=True, seed=0, **kwargs):
    """A tiny random GPT-2 in float64 running causal Sinkhorn attention (``causal=True``)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=23, n_positions=80, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=None,
                                     pad_token_id=0, initializer_range=0.2, **kwargs)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    model.set_attn_implementation(register(n_iters, name=f"sinkhorn_causal_{n_iters}_{causal}", causal=causal))
    return model


def left_padded(batch=2, length=6):
    ids = torch.randint(2, 23, (batch, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("n_iters", [2, 3, 5])
def test_gpt2_causal_sinkformer_does_not_leak_and_is_not_softmax(n_iters, recwarn):
    model = gpt2(n_iters)
    ids = torch.randint(2, 23, (2, 8))
    embeddings = model.transformer.wte(ids).detach()
    assert future_gradient(lambda e: model(inputs_embeds=e, use_cache=False).logits, embeddings, t=3) == 0.0
    with torch.no_grad():
        ours = model(ids).logits
        model.set_attn_implementation("sdpa")
        softmax = model(ids).logits
    assert (ours - softmax).abs().max() > 1e-3
    assert not [w for w in recwarn if "keep SoftMax" in str(w.message)]  # no layer kept SoftMax


def test_gpt2_with_one_iteration_is_its_softmax_model():
    model = gpt2(1)
    ids, mask = left_padded()
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], eager[real], rtol=0, atol=1e-10)


@pytest.mark.parametrize("n_iters", [1, 3, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_gpt2_generate_uses_the_incremental_state_and_matches_the_full_forward(n_iters, padded):
    """Greedy, 50 new tokens, float64: the tokens and logits of generate() (KV cache plus the layers'
    causal Sinkhorn states) are those of one full forward over the generated sequence."""
    model = gpt2(n_iters)
    ids, mask = left_padded()
    if not padded:
        mask = torch.ones_like(mask)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=50, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    sequences, logits = out.sequences, torch.stack(out.logits, 1)
    assert sequences.shape == (2, 56)
    assert len(model.transformer.h[0].attn._sinkformer_decoding.cache) == 55  # the incremental state ran
    full_mask = torch.cat([mask, torch.ones(2, 49, dtype=torch.long)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(sequences[:, :-1], attention_mask=full_mask, position_ids=positions, use_cache=False).logits
    full = full[:, 5:].to(logits.dtype)  # generate() hands out float32 logits
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)
    assert torch.equal(sequences[:, 6:], full.argmax(-1))


def test_llama_with_grouped_query_heads_generates_like_its_full_forward():
    """Rotary positions and grouped key/value heads (2 for 4 query heads), left padding."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=23, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=80,
                                      bos_token_id=1, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).double().eval()
    model.set_attn_implementation(register(3, name="sinkhorn_causal_llama", causal=True))
    ids, mask = left_padded()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    full_mask = torch.cat([mask, torch.ones(2, 19, dtype=torch.long)], 1)
    with torch.no_grad():
        full = model(out.sequences[:, :-1], attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp_min(0),
                     use_cache=False).logits[:, 5:]
    torch.testing.assert_close(torch.stack(out.logits, 1), full.to(torch.float32), rtol=0, atol=1e-5)
    assert torch.equal(out.sequences[:, 6:], full.argmax(-1))


def test_gpt2_cached_steps_equal_the_full_forward_in_float64():
    """The same with past_key_values by hand, several tokens per step, no float32 cast in between."""
    model = gpt2(4)
    ids = torch.randint(2, 23, (2, 12))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        first = model(ids[:, :5], use_cache=True)
        second = model(ids[:, 5:8], past_key_values=first.past_key_values, use_cache=True)
        third = model(ids[:, 8:], past_key_values=second.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits, third.logits], 1), full, rtol=0, atol=1e-12)


def test_gpt2_decoding_refuses_states_it_cannot_serve():
    model = gpt2(3)
    ids = torch.randint(2, 23, (2, 6))
    first = model(ids, use_cache=True)  # with gradients: no decoding state is recorded
    with torch.no_grad(), pytest.raises(ValueError, match="has not seen.*without gradients"):
        model(ids[:, :1], past_key_values=first.past_key_values)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        model(ids[:, :1], past_key_values=cache)
        other = model(ids.flip(0), use_cache=True).past_key_values  # resets the state to another prompt
        with pytest.raises(ValueError, match="has not seen"):
            model(ids[:, :1], past_key_values=cache)
        model(ids[:, :1], past_key_values=other)  # the prompt the state holds
    with pytest.raises(ValueError, match="has not seen.*beam search"):  # beam search reorders the cache
        model.generate(ids[:1], max_new_tokens=8, num_beams=3, do_sample=False)


def test_causal_key_padding_reads_causal_masks_and_refuses_others():
    keep = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5).clone()
    keep[0, ..., :2] = False  # left padding
    assert hf.causal_key_padding(keep, 5, 5).tolist() == [[True, True, False, False, False], [False] * 5]
    as_float = torch.zeros(2, 1, 5, 5).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert torch.equal(hf.causal_key_padding(as_float, 5, 5), hf.causal_key_padding(keep, 5, 5))
    assert hf.causal_key_padding(keep[..., 3:, :], 2, 5) is not None  # queries 3, 4 with a past of 3
    assert hf.causal_key_padding(keep[1:], 5, 5) is None  # no padding
    window = keep & torch.ones(5, 5, dtype=torch.bool).triu(-1)  # a sliding window of 2
    with pytest.raises(ValueError, match="causal mask with key padding"):
        hf.causal_key_padding(window, 5, 5)
    as_old_float = torch.zeros(2, 1, 5, 5).masked_fill(~keep, -1e4)  # transformers < 4.x wrote -10000
    assert torch.equal(hf.causal_key_padding(as_old_float, 5, 5), hf.causal_key_padding(keep, 5, 5))
    torch._dynamo.reset()  # compiled, the pattern check is an assert in the graph
    compiled = torch.compile(lambda mask: hf.causal_key_padding(mask, 5, 5), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(keep), hf.causal_key_padding(keep, 5, 5))
    with pytest.raises(RuntimeError, match="causal mask with key padding"):
        compiled(window)


def test_cross_attention_keeps_softmax_when_causal_self_attention_is_sinkhorn():
    config = dict(is_decoder=True, add_cross_attention=True)
    sdpa = transformers.AutoModelForCausalLM.from_config(bert_config(**config), attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_config(
        bert_config(**config), attn_implementation=register(3, "sinkhorn_causal_bert", causal=True)).eval()
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(5, len(WORDS), (2, 7))
    memory = torch.randn(2, 3, 32)
    with torch.no_grad(), pytest.warns(UserWarning, match="cross-attention layers keep SoftMax") as record:
        got = ours(input_ids=ids, encoder_hidden_states=memory).logits
    assert {str(w.message).split(":")[0] for w in record} == {"BertCrossAttention"}
    with torch.no_grad():
        assert (got - sdpa(input_ids=ids, encoder_hidden_states=memory).logits).abs().max() > 1e-3
    changed = ids.clone()
    changed[:, 4:] = torch.randint(5, len(WORDS), (2, 3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = ours(input_ids=changed, encoder_hidden_states=memory).logits
    torch.testing.assert_close(again[:, :4], got[:, :4], rtol=0, atol=1e-5)  # float32 rounding
    assert (again[:, 4:] - got[:, 4:]).abs().max() > 1e-2


# --- packaging and the README ----------------------------------------------------------------------


def test_core_does_not_import_transformers():
    code = "import sys, sinkformer, sinkformer.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, hf.__name__)
    with pytest.raises(ImportError, match=re.escape("pip install 'sinkformer[hf]'")):
        importlib.import_module(hf.__name__)


def readme_example() -> str:
    """The first python block of ``docs/huggingface.md`` (the §6.3 workflow on a local checkpoint)."""
    return re.search(r"```python\n(.*?)```", HF_PAGE.read_text(), re.S).group(1)


def test_readme_example_runs_on_a_tiny_local_checkpoint(tmp_path, monkeypatch):
    code = readme_example()
    checkpoint = re.search(r'checkpoint = "([^"]+)"', code).group(1)
    monkeypatch.chdir(tmp_path)
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})
    tokenizer.save_pretrained(checkpoint)
    config = bert_config(num_labels=2, initializer_range=0.02, hidden_dropout_prob=0.1)
    transformers.BertForSequenceClassification(config).save_pretrained(checkpoint)
    namespace = {}
    exec(compile(code, str(HF_PAGE), "exec"), namespace)
    saved = [p for p in tmp_path.iterdir() if p.name != checkpoint and (p / "config.json").exists()]
    assert saved, "the docs example saves the fine-tuned Sinkformer"
    assert torch.isfinite(namespace["loss"])
