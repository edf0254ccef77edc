"""Eight model families that nobody in this project wrote, from `transformers` configs at a tiny
size, each wrapped so that `forward(*batch)` returns the scalar loss: what a user brings.

`transformers` is a test dependency (the dev extra): `pip install -e ".[dev]"`."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

IGNORE = -100  # the label transformers' losses skip


class WithLoss(torch.nn.Module):
    """`model(**{names[i]: batch[i]}).loss`: a transformers model as HiDup takes it."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *batch):
        return self.model(**dict(zip(self.names, batch))).loss


@dataclass(frozen=True)
class ThirdParty:
    """A third-party model at tiny size: how to build it and make one global batch."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]  # (global batch, generator)


def _lm_batch(vocab: int, seq: int):
    def make(n: int, gen: torch.Generator):
        ids = torch.randint(0, vocab, (n, seq), generator=gen)
        labels = ids.clone()
        labels[:, -3:] = IGNORE  # padded tail: a loss over the kept targets only
        labels[0, :2] = IGNORE
        return ids, labels
    return make


def _image_batch(classes: int, size: int):
    def make(n: int, gen: torch.Generator):
        return (torch.randn(n, 3, size, size, generator=gen),
                torch.randint(0, classes, (n,), generator=gen))
    return make


def _transformers(config: str, model: str, names: tuple[str, ...], **settings):
    """A builder of transformers' `model` class from its `config` class with these settings."""
    def build() -> torch.nn.Module:
        import transformers
        transformers.logging.set_verbosity_error()  # its notes on the tiny configs say nothing
        cfg = getattr(transformers, config)(**settings)
        return WithLoss(getattr(transformers, model)(cfg), names)
    return build


TEXT, IMAGE = ("input_ids", "labels"), ("pixel_values", "labels")
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=32)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_gpt2 = _transformers("GPT2Config", "GPT2LMHeadModel", TEXT, vocab_size=96, n_positions=32,
                      n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, use_cache=False)
_llama = _transformers("LlamaConfig", "LlamaForCausalLM", TEXT, **SMALL, num_key_value_heads=2,
                       use_cache=False)
_bert = _transformers("BertConfig", "BertForSequenceClassification", TEXT, **SMALL, num_labels=3,
                      **NO_DROPOUT)
_mixtral = _transformers("MixtralConfig", "MixtralForCausalLM", TEXT, **SMALL,
                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         use_cache=False)
_vit = _transformers("ViTConfig", "ViTForImageClassification", IMAGE, image_size=16, patch_size=4,
                     hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_labels=5, **NO_DROPOUT)
# encoder-decoders: their decoder's inputs are the labels shifted right, written into a slice of
# a new tensor in place (shift_tokens_right), which capture makes functional
_bart = _transformers("BartConfig", "BartForConditionalGeneration", TEXT, vocab_size=96,
                      d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                      max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0)
_t5 = _transformers("T5Config", "T5ForConditionalGeneration", TEXT, vocab_size=96, d_model=32,
                    d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                    dropout_rate=0.0, decoder_start_token_id=0)
_resnet = _transformers("ResNetConfig", "ResNetForImageClassification", IMAGE, embedding_size=8,
                        hidden_sizes=[8, 16], depths=[1, 1], num_labels=5, layer_type="basic")


def _seq_batch(vocab: int, seq: int, classes: int):
    def make(n: int, gen: torch.Generator):
        return (torch.randint(0, vocab, (n, seq), generator=gen),
                torch.randint(0, classes, (n,), generator=gen))
    return make


MODELS = {m.name: m for m in (
    ThirdParty("gpt2", _gpt2, _lm_batch(96, 16)),
    ThirdParty("llama", _llama, _lm_batch(96, 16)),
    ThirdParty("bert", _bert, _seq_batch(96, 16, 3)),
    ThirdParty("mixtral", _mixtral, _lm_batch(96, 16)),
    ThirdParty("vit", _vit, _image_batch(5, 16)),
    ThirdParty("resnet", _resnet, _image_batch(5, 16)),
    ThirdParty("bart", _bart, _lm_batch(96, 16)),
    ThirdParty("t5", _t5, _lm_batch(96, 16)),
)}


def any_model(spec: str) -> ThirdParty:
    """Any `transformers` model class at a tiny size, from 'ConfigClass:ModelClass' (e.g.
    'Qwen2Config:Qwen2ForCausalLM'): the settings of SMALL that the config knows, without
    dropout; a causal LM, sequence or image classifier by the model class's name."""
    import inspect

    import transformers

    transformers.logging.set_verbosity_error()  # (a default config may warn about itself)
    config_name, _, model_name = spec.partition(":")
    if not model_name or not hasattr(transformers, config_name) or \
            not hasattr(transformers, model_name):
        raise ValueError(f"model {spec!r}: give 'ConfigClass:ModelClass' of transformers, e.g. "
                         f"Qwen2Config:Qwen2ForCausalLM")
    config = getattr(transformers, config_name)
    defaults = config().to_dict()
    known = set(inspect.signature(config.__init__).parameters) | set(defaults)
    tiny = {**SMALL, **NO_DROPOUT, "image_size": 16, "patch_size": 4, "num_labels": 5,
            "num_key_value_heads": 2, "use_cache": False, "hidden_dropout": 0.0,
            "attention_dropout": 0.0, "dropout": 0.0, "ffn_dim": 64, "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2}
    renamed = getattr(config, "attribute_map", {})  # e.g. GPT-J's n_embd for hidden_size
    settings = {renamed.get(k, k): v for k, v in tiny.items() if renamed.get(k, k) in known}
    # every dropout off, whatever the family calls it (resid_pdrop, classifier_dropout_prob,
    # seq_classif_dropout, layerdrop...): a step is then deterministic, as eager's reference
    settings.update({k: 0.0 for k, v in defaults.items()
                     if isinstance(v, float) and "drop" in k})
    if model_name.endswith("ForImageClassification"):  # 64 pixels: convnets downsample 32x
        settings["num_labels"] = 5
        settings.update({k: 64 for k in ("image_size",) if k in known})
        names, batch = IMAGE, _image_batch(5, 64)
    elif model_name.endswith("ForSequenceClassification"):
        settings["num_labels"] = 5
        names, batch = TEXT, _seq_batch(96, 16, 5)
    else:
        names, batch = TEXT, _lm_batch(96, 16)
    return ThirdParty(spec, _transformers(config_name, model_name, names, **settings), batch)


# more families, each at any_model's tiny size: causal LMs (dense and mixture-of-experts),
# encoders for sequence classification and vision transformers
MORE_SPECS = {
    "qwen2": "Qwen2Config:Qwen2ForCausalLM", "qwen3": "Qwen3Config:Qwen3ForCausalLM",
    "mistral": "MistralConfig:MistralForCausalLM", "phi": "PhiConfig:PhiForCausalLM",
    "phi3": "Phi3Config:Phi3ForCausalLM", "gemma": "GemmaConfig:GemmaForCausalLM",
    "gemma2": "Gemma2Config:Gemma2ForCausalLM", "gpt_neox": "GPTNeoXConfig:GPTNeoXForCausalLM",
    "opt": "OPTConfig:OPTForCausalLM", "bloom": "BloomConfig:BloomForCausalLM",
    "falcon": "FalconConfig:FalconForCausalLM", "starcoder2": "Starcoder2Config:Starcoder2ForCausalLM",
    "olmo2": "Olmo2Config:Olmo2ForCausalLM", "cohere": "CohereConfig:CohereForCausalLM",
    "granite": "GraniteConfig:GraniteForCausalLM", "glm": "GlmConfig:GlmForCausalLM",
    "gpt_bigcode": "GPTBigCodeConfig:GPTBigCodeForCausalLM",
    "qwen2_moe": "Qwen2MoeConfig:Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeConfig:Qwen3MoeForCausalLM",
    "granite_moe": "GraniteMoeConfig:GraniteMoeForCausalLM",
    "roberta": "RobertaConfig:RobertaForSequenceClassification",
    "distilbert": "DistilBertConfig:DistilBertForSequenceClassification",
    "albert": "AlbertConfig:AlbertForSequenceClassification",
    "electra": "ElectraConfig:ElectraForSequenceClassification",
    "deit": "DeiTConfig:DeiTForImageClassification",
    "dinov2": "Dinov2Config:Dinov2ForImageClassification",
}


def more_model(name: str) -> ThirdParty:
    """One of MORE_SPECS by its short name."""
    return replace(any_model(MORE_SPECS[name]), name=name)


def model_spec(name: str) -> ThirdParty:
    """One of MODELS or MORE_SPECS by name, or any transformers model as
    'ConfigClass:ModelClass'."""
    if name in MODELS:
        return MODELS[name]
    if name in MORE_SPECS:
        return more_model(name)
    if ":" in name:
        return any_model(name)
    raise ValueError(f"model {name!r}: give one of {sorted(MODELS) + sorted(MORE_SPECS)} or a "
                     f"transformers "
                     f"'ConfigClass:ModelClass'")


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The named model (see model_spec) with seeded weights, in training mode."""
    spec = model_spec(name)
    torch.manual_seed(seed)
    return spec.build().train()
