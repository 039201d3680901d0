"""Tests for remat.blocks: block detection on built-in, Hugging Face and custom models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.blocks import find_blocks, find_sublayer, named_blocks
from remat.errors import BlocksNotFound
from remat.models import GPTBlock, LlamaBlock, build_model

transformers = pytest.importorskip("transformers")

H = 32  # hidden size of every tiny Hugging Face model here


def hf_gpt2():
    cfg = transformers.GPT2Config(n_embd=H, n_layer=2, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama():
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    return transformers.LlamaForCausalLM(cfg)


def hf_bert():
    cfg = transformers.BertConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=64)
    return transformers.BertModel(cfg)


def hf_t5():
    cfg = transformers.T5Config(d_model=H, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=3,
                                num_heads=4, vocab_size=64)
    return transformers.T5ForConditionalGeneration(cfg)


def hf_vit():
    cfg = transformers.ViTConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, image_size=16, patch_size=4)
    return transformers.ViTModel(cfg)


def test_builtin_models():
    gpt = build_model("gpt-tiny")
    assert [n for n, _ in named_blocks(gpt)] == ["blocks.0", "blocks.1"]
    assert find_blocks(gpt) == list(gpt.blocks)
    llama = build_model("llama-tiny", n_layer=3)
    assert all(isinstance(b, LlamaBlock) for b in find_blocks(llama))
    assert len(find_blocks(llama)) == 3
    assert find_sublayer(gpt.blocks[0], "attn") == ("attn", gpt.blocks[0].attn)
    assert find_sublayer(llama.blocks[1], "mlp") == ("mlp", llama.blocks[1].mlp)


@pytest.mark.parametrize(
    ("factory", "names", "block_cls", "attn", "mlp"),
    [
        (hf_gpt2, ["transformer.h.0", "transformer.h.1"], "GPT2Block", "attn", "mlp"),
        (hf_llama, ["model.layers.0", "model.layers.1"], "LlamaDecoderLayer", "self_attn", "mlp"),
        (hf_bert, ["encoder.layer.0", "encoder.layer.1"], "BertLayer", "attention", None),
    ],
)
def test_hugging_face_decoders_and_encoders(factory, names, block_cls, attn, mlp):
    model = factory()
    found = named_blocks(model)
    assert [n for n, _ in found] == names
    assert {type(m).__name__ for _, m in found} == {block_cls}
    assert all(model.get_submodule(n) is m for n, m in found)
    block = found[0][1]
    assert find_sublayer(block, "attn")[0] == attn
    if mlp is not None:
        assert find_sublayer(block, "mlp")[0] == mlp


def test_bert_mlp_needs_names_and_says_so():
    block = find_blocks(hf_bert())[0]
    with pytest.raises(BlocksNotFound, match=r"(?s)no mlp sub-layer in BertLayer.*intermediate "
                                             r"\(BertIntermediate\).*fix: pass names="):
        find_sublayer(block, "mlp")
    assert find_sublayer(block, "mlp", names=["intermediate"])[0] == "intermediate"
    name, module = find_sublayer(block, "attn", names=["attention.self"])
    assert name == "attention.self" and module is block.attention.self


def test_t5_returns_both_stacks_in_forward_order():
    model = hf_t5()
    names = [n for n, _ in named_blocks(model)]
    assert names == ["encoder.block.0", "encoder.block.1",
                     "decoder.block.0", "decoder.block.1", "decoder.block.2"]
    enc, dec = model.encoder.block[0], model.decoder.block[0]
    assert find_sublayer(enc, "attn") == ("layer.0.SelfAttention", enc.layer[0].SelfAttention)
    assert find_sublayer(dec, "mlp")[0] == "layer.2.DenseReluDense"


def test_vit():
    model = hf_vit()
    found = named_blocks(model)
    assert len(found) == 2 and {type(m).__name__ for _, m in found} == {"ViTLayer"}
    assert "attention" in find_sublayer(found[0][1], "attn")[0]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ffn(x + self.attention(x))


class OtherBlock(Block):
    pass


class Nested(nn.Module):
    """Two stages of blocks in a ModuleList of ModuleLists, plus a small homogeneous head."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.stages = nn.ModuleList([nn.ModuleList([Block(d), Block(d)]),
                                     nn.ModuleList([Block(d), Block(d), Block(d)])])
        self.heads = nn.ModuleList([nn.Linear(d, 1), nn.Linear(d, 1)])  # tiny: never blocks

    def forward(self, x):
        x = self.embed(x)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return sum(h(x) for h in self.heads)


def test_custom_nested_module_lists():
    model = Nested()
    names = [n for n, _ in named_blocks(model)]
    # The inner Sequential (two Linears) of every block is never returned: nested in a block.
    assert names == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1", "stages.1.2"]


def test_encoder_decoder_of_different_classes_and_threshold():
    class EncDec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList([Block(16) for _ in range(2)])
            self.decoder = nn.ModuleList([OtherBlock(16) for _ in range(3)])
            self.norms = nn.ModuleList([nn.LayerNorm(16), nn.LayerNorm(16)])  # < 10% of params

    names = [n for n, _ in named_blocks(EncDec())]
    assert names == ["encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.2"]


def test_mixed_sequential_picks_the_repeated_class():
    model = nn.Sequential(nn.Embedding(10, 16), Block(16), Block(16), Block(16), nn.Linear(16, 10))
    assert [n for n, _ in named_blocks(model)] == ["1", "2", "3"]


def test_blocks_spec_class_tuple_and_predicate():
    model = build_model("gpt-tiny")
    assert [n for n, _ in named_blocks(model, GPTBlock)] == ["blocks.0", "blocks.1"]
    assert len(find_blocks(model, [GPTBlock, LlamaBlock])) == 2
    # Predicates get qualified names and only outermost matches are returned.
    mlps = named_blocks(model, lambda name, m: name.endswith("mlp"))
    assert [n for n, _ in mlps] == ["blocks.0.mlp", "blocks.1.mlp"]
    outer = named_blocks(model, lambda name, m: isinstance(m, (GPTBlock, nn.Linear)))
    assert [n for n, _ in outer] == ["blocks.0", "blocks.1", "lm_head"]
    t5_blocks = find_blocks(hf_t5(), lambda name, m: name.startswith("decoder.block."))
    assert len(t5_blocks) == 3


def test_explicit_spec_errors():
    model = build_model("gpt-tiny")
    with pytest.raises(BlocksNotFound, match=r"(?s)blocks=LlamaBlock matched no submodule of GPT"
                                             r".*classes present: .*GPTBlock"):
        named_blocks(model, LlamaBlock)
    with pytest.raises(TypeError, match="not an nn.Module subclass"):
        named_blocks(model, int)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must hold nn.Module subclasses"):
        named_blocks(model, [GPTBlock, "x"])  # type: ignore[list-item]


def test_not_found_messages():
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout())
    with pytest.raises(BlocksNotFound) as info:
        find_blocks(flat)
    msg = str(info.value)
    assert "remat.find_blocks: no repeated blocks found in Sequential" in msg
    assert "<root> (Sequential: Linear x1, ReLU x1, Dropout x1)" in msg
    assert "blocks=LlamaDecoderLayer" in msg and "blocks=lambda name, module:" in msg
    assert isinstance(info.value, ValueError)

    with pytest.raises(BlocksNotFound, match=r"(?s)^remat.apply: .*no nn.ModuleList"):
        named_blocks(nn.Linear(2, 2), api="remat.apply")


def test_find_sublayer_fallbacks_and_errors():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer_a = Attn()  # found by class name only
            self.inner = nn.Module()
            self.inner.feed_forward = nn.Linear(4, 4)  # found by descendant name

    odd = Odd()
    assert find_sublayer(odd, "attn") == ("mixer_a", odd.mixer_a)
    assert find_sublayer(odd, "mlp") == ("inner.feed_forward", odd.inner.feed_forward)
    with pytest.raises(BlocksNotFound, match=r"no attn sub-layer in Odd\n  looked for names: "
                                             r"nope\n  children: mixer_a \(Attn\)"):
        find_sublayer(odd, "attn", names=["nope"])
    with pytest.raises(ValueError, match="kind must be 'attn' or 'mlp'\n  found: 'norm'"):
        find_sublayer(odd, "norm")  # type: ignore[arg-type]


@pytest.mark.parametrize("cls_name", ["MistralForCausalLM", "Qwen2ForCausalLM"])
def test_other_hf_decoders(cls_name):
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    cfg = config_cls(hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = getattr(transformers, cls_name)(cfg)
    found = named_blocks(model)
    assert [n for n, _ in found] == ["model.layers.0", "model.layers.1"]
    assert find_sublayer(found[0][1], "attn")[0] == "self_attn"
    assert find_sublayer(found[0][1], "mlp")[0] == "mlp"
    # The blocks still run with the model's own forward.
    out = model(torch.zeros(1, 4, dtype=torch.long))
    assert out.logits.shape == (1, 4, 64)


class FirstBlock(nn.Module):
    """A stack's first layer of another class: the same forward, one child more (a norm)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.attention = nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.ffn(x + self.attention(x)))


class Tower(nn.Module):
    """A small convolution-like stack (its first layer another class) beside a wide one."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.ModuleList([FirstBlock(4), Block(4), Block(4)])  # < 1% of params
        self.layers = nn.ModuleList([Block(64) for _ in range(2)])


def test_first_layer_of_another_class_and_small_tower_are_blocks():
    names = [n for n, _ in named_blocks(Tower())]
    assert names == ["features.0", "features.1", "features.2", "layers.0", "layers.1"]


def test_first_member_of_another_shape_stays_out():
    class Different(nn.Module):  # other children: not a layer of the stack
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            return self.proj(x)

    model = nn.Sequential(Different(), Block(16), Block(16))
    assert [n for n, _ in named_blocks(model)] == ["1", "2"]


def test_speech_feature_encoder_is_found_with_its_first_layer():
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4)
    with torch.device("meta"):
        model = transformers.Wav2Vec2ForCTC(config)
    names = [n for n, _ in named_blocks(model)]
    conv = [n for n in names if "conv_layers" in n]
    assert conv == [f"wav2vec2.feature_extractor.conv_layers.{i}" for i in range(3)]
    assert names[-2:] == ["wav2vec2.encoder.layers.0", "wav2vec2.encoder.layers.1"]
