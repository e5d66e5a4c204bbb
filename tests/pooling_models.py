"""Tiny random pooling models saved as folders, for tests (imported by bare name).

Each builder writes a folder that both sentence-transformers (or transformers) and aiolm
load: random weights from a fixed seed, a tokenizer built here from a small vocabulary
with the ``tokenizers`` library (no hub), and returns the folder's path. The sizes are
small enough that building and running one takes well under a second.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

# a vocabulary of whole words, so test sentences tokenize to real ids, not [UNK]
WORDS = (
    "the a an of to in and is was on for with as by at from it this that be are or "
    "cat dog fish bird sat ran swam flew mat park sea sky red blue green small big "
    "paris france rome italy capital city river mountain embedding model vector search "
    "query document answer question what where how why who when good bad fast slow"
).split()


def _wordpiece_tokenizer(folder: Path, max_length: int) -> None:
    """A lower-casing BERT WordPiece tokenizer ([CLS] text [SEP], pairs with token types)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = sorted({c for w in WORDS for c in w})
    vocab = {t: i for i, t in enumerate(specials + WORDS + letters + [f"##{c}" for c in letters])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = BertTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )
    fast.save_pretrained(str(folder))


def _bert_config(num_labels: int | None = None):  # -> transformers.BertConfig
    from transformers import BertConfig

    extra = {} if num_labels is None else {"num_labels": num_labels}
    return BertConfig(
        vocab_size=len(WORDS) + 5 + 2 * len({c for w in WORDS for c in w}),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        hidden_act="gelu",
        **extra,
    )


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn afresh, LayerNorms included (transformers initialises them to
    ones and zeros, which would leave a wrong weight/bias mapping unseen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.endswith("LayerNorm.weight") else 0.0))


def bert_embedder(folder: Path | str, pooling: str = "mean", normalize: bool = True, seed: int = 0) -> Path:
    """A sentence-transformers folder: BertModel (weights without the "bert." prefix),
    ``pooling`` ("mean" or "cls") and, with ``normalize``, a Normalize module."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = BertModel(_bert_config())
    _randomize(model, seed)
    model.save_pretrained(str(folder))
    _wordpiece_tokenizer(folder, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = Transformer(str(folder), max_seq_length=128)
        modules = [first, Pooling(model.config.hidden_size, pooling_mode=pooling)]
        if normalize:
            modules.append(Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def bert_cross_encoder(folder: Path | str, num_labels: int = 1, seed: int = 1) -> Path:
    """A BertForSequenceClassification folder ("bert." prefix, pooler, classifier) that
    ``sentence_transformers.CrossEncoder`` loads."""
    from transformers import BertForSequenceClassification

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = BertForSequenceClassification(_bert_config(num_labels))
    _randomize(model, seed)
    model.save_pretrained(str(folder))
    _wordpiece_tokenizer(folder, 128)
    return folder


def _qwen_tokenizer(folder: Path) -> None:
    """A word-level tokenizer that appends <|endoftext|> to every text (as Qwen3-Embedding's
    does, so last-token pooling reads it) and pads on the left."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    eos = vocab["<|endoftext|>"]
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1", special_tokens=[("<|endoftext|>", eos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        model_max_length=256,
    )
    fast.save_pretrained(str(folder))


def qwen3_embedder(folder: Path | str, seed: int = 2) -> Path:
    """A sentence-transformers folder of a tiny random Qwen3 (the bare decoder, no LM head)
    with last-token pooling and Normalize, as Qwen3-Embedding is saved."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import Qwen3Config, Qwen3Model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(WORDS) + 2,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # so a build to generate finds no LM head (tests/model/test_bert.py)
        eos_token_id=0,
        pad_token_id=0,
    )
    model = Qwen3Model(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(str(folder))
    _qwen_tokenizer(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = Transformer(str(folder), max_seq_length=256)
        modules = [first, Pooling(cfg.hidden_size, pooling_mode="lasttoken"), Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder
