"""The tiny exports the runtime tests share (imported by conftest.py and the test modules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tfport.config import ModelConfig
from tfport.presets import get_preset


@dataclass(frozen=True)
class ExportCase:
    """One exported model: a preset, config overrides, a seed and export options."""

    preset: str
    overrides: dict = field(default_factory=dict)
    seed: int = 0
    dtype: str = "float32"
    options: dict = field(default_factory=dict)

    @property
    def config(self) -> ModelConfig:
        return get_preset(self.preset).replace(**self.overrides)


# Random tiny models with tied embeddings mostly repeat one token greedily (the residual stream
# stays close to the last token's own embedding), which would make a parity test vacuous; the
# untied variants keep the position scheme of their preset and give varied continuations.
CASES = {
    "decoder-rope": ExportCase("tiny-decoder"),
    "decoder-learned": ExportCase("tiny-decoder-gpt2", {"tie_embeddings": False}),
    "decoder-alibi": ExportCase("tiny-decoder-alibi", {"tie_embeddings": False}),
    "encoder-decoder": ExportCase("tiny-encoder-decoder", {"tie_embeddings": False}),
    # target ort (the inplace cache layout): its attention kernel needs heads of 16
    "decoder-ort": ExportCase("tiny-decoder", {"tie_embeddings": False, "d_model": 64}, options={"target": "ort"}),
    "encoder": ExportCase("tiny-encoder"),
    "decoder-fp16": ExportCase("tiny-decoder", dtype="float16"),
    # every weight in <graph>.onnx.data, to test a missing external-data file
    "decoder-external": ExportCase("tiny-decoder", options={"external_data_threshold": 0}),
    # with a word-level tokenizer.json (see write_tokenizer)
    "decoder-text": ExportCase("tiny-decoder", options={"tokenizer": "word-level"}),
    "encoder-text": ExportCase("tiny-encoder", options={"tokenizer": "word-level"}),
}
DECODER_CASES = ["decoder-rope", "decoder-learned", "decoder-alibi"]


@dataclass
class Exported:
    case: ExportCase
    model: object  # the torch reference module
    path: Path


class ExportStore:
    """Lazily exports ``CASES`` into one temporary directory, each at most once."""

    def __init__(self, root: Path):
        self.root = root
        self._done: dict[str, Exported] = {}

    def __call__(self, key: str) -> Exported:
        if key not in self._done:
            from tfport.export import ExportOptions, export_model
            from tfport.models import build_model

            case = CASES[key]
            model = build_model(case.config, seed=case.seed)
            path = self.root / key
            options = dict(case.options)
            if options.get("tokenizer") == "word-level":
                options["tokenizer"] = write_tokenizer(self.root / f"{key}-tokenizer.json",
                                                       case.config)
            export_model(model, path, ExportOptions(dtype=case.dtype, **options))
            self._done[key] = Exported(case, model, path)
        return self._done[key]


def write_tokenizer(path: Path, config: ModelConfig) -> Path:
    """A word-level ``tokenizer.json``: ``[PAD] [BOS] [EOS] [UNK]`` then ``w4 ... w{V-1}``.

    Special ids follow the config (pad 0, bos 1, eos 2); a template adds [BOS] in front.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), config.vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    tokenizer.save(str(path))
    return path
