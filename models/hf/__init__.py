"""Import Hugging Face checkpoints (``config.json`` + ``*.safetensors``) into the reference modules.

Reads the directory directly -- JSON and safetensors, never ``transformers``, never unpickled.
Each family is one module holding its config function (HF config dict -> ``ModelConfig``,
refusing what tfport cannot express exactly) and its ``Architecture``, a table of ``Rule`` s
(``rules``) saying which HF tensors make each tfport tensor and how; ``ARCHITECTURES`` maps each
``model_type`` to it, so adding a family is one module and one entry. ``loader`` checks every key
and shape before reading anything (``weights`` reads the files). Weights are loaded as float32
whatever their stored dtype; ``tfport export --dtype`` picks the exported precision.

Other weight formats (GGUF) come in through ``load_from_tensors`` with their own ``TensorSource``
presenting the HF tensor names.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from torch import nn

from tfport.config import ModelConfig

from . import loader
from .bart import BART
from .bert import BERT
from .bloom import BLOOM
from .configs import CONFIG_FILE, read_json
from .deberta import DEBERTA
from .distilbert import DISTILBERT
from .falcon import FALCON
from .gemma import GEMMA, GEMMA2
from .gpt2 import GPT2
from .gptj import GPTJ
from .granitemoe import GRANITE_MOE
from .llama import LLAMA
from .loader import TensorSource
from .marian import MARIAN
from .mixtral import MIXTRAL
from .modernbert import MODERNBERT
from .mpt import MPT
from .mt5 import MT5
from .neox import NEOX
from .olmoe import OLMOE
from .opt import OPT
from .phi import PHI
from .phi3 import PHI3
from .qwen import QWEN
from .qwen2_moe import QWEN_MOE
from .stablelm import STABLELM
from .starcoder2 import STARCODER2
from .roberta import ROBERTA
from .rules import Architecture, Rule, Transform, concat_rows, params
from .t5 import T5
from .weights import WEIGHTS_FILE, SafetensorsTensors

ARCHITECTURES: dict[str, Architecture] = {
    model_type: arch for arch in (LLAMA, QWEN, GEMMA, GEMMA2, NEOX, PHI3, STABLELM, OPT, FALCON, GPTJ, GPT2, BERT, BLOOM, MPT, T5) for model_type in arch.model_types}
ARCHITECTURES.update({t: arch for arch in (ROBERTA, DISTILBERT, MT5) for t in arch.model_types})  # encoders (issue 13)
ARCHITECTURES.update({t: DEBERTA for t in DEBERTA.model_types})  # DeBERTa-v3
ARCHITECTURES.update({t: MODERNBERT for t in MODERNBERT.model_types})
ARCHITECTURES.update({t: arch for arch in (BART, MARIAN) for t in arch.model_types})  # BART, mBART, Marian
ARCHITECTURES.update({t: arch for arch in (MIXTRAL, QWEN_MOE, OLMOE, GRANITE_MOE)  # mixtures of experts
                      for t in arch.model_types})
ARCHITECTURES.update({t: arch for arch in (PHI, STARCODER2) for t in arch.model_types})  # issue 26


# Families looked at and refused: model_type -> what tfport cannot compute exactly.
REFUSED_MODEL_TYPES: dict[str, str] = {
    "gpt_oss": "gpt-oss needs attention sinks (a learned logit per head joining every softmax: "
               "self_attn.sinks), a clamped SwiGLU with biases (gate clamped above and up on both sides at "
               "swiglu_limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1), gate and up rows interleaved) "
               "and, in the published checkpoints, MXFP4 expert weights; tfport has none of these",
}


def _architecture(hf: dict) -> Architecture:
    if not isinstance(hf, dict):
        raise TypeError(f"hf_config: expected the dict of a config.json, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported: "
                         f"{REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"config.json: model_type={model_type!r} (architectures="
                         f"{hf.get('architectures')}) is not one tfport imports; expected one of "
                         f"{sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[model_type]
    classes = hf.get("architectures") or []
    unknown = [c for c in classes if c not in arch.classes]
    if unknown:
        raise ValueError(f"config.json: architectures={classes} of model_type={model_type!r}: "
                         f"tfport imports {list(arch.classes)}, not {unknown} (its head has no "
                         "tfport counterpart)")
    return arch


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` is a Hugging Face one.

    HF configs name a ``model_type`` or ``architectures``; tfport's own checkpoints (also
    ``config.json`` + ``model.safetensors``) have a ``family`` instead. The weights are not looked
    at here: ``load_hf_model`` says what is wrong with them.
    """
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        data = read_json(config)
    except ValueError:
        return False
    return "family" not in data and ("model_type" in data or "architectures" in data)


def hf_config_to_tfport(hf_config: dict, keys: Iterable[str] | None = None) -> ModelConfig:
    """The tfport ``ModelConfig`` of a Hugging Face ``config.json`` (as a dict).

    ``keys``, the checkpoint's tensor names if known, settles which optional heads exist (BERT's
    pooler and MLM head); without them the ``architectures`` class decides. Raises ``ValueError``
    for an unknown architecture or an option tfport cannot compute exactly.
    """
    arch = _architecture(hf_config)
    normalized = None if keys is None else frozenset(arch.normalize(k) for k in keys)
    return arch.config(hf_config, normalized)


def load_from_tensors(hf_config: dict, tensors: TensorSource, origin: str, lazy: bool = False) -> nn.Module:
    """The tfport reference module (eval mode, float32, ``.config`` set) of a Hugging Face config
    (the dict of a ``config.json``) and its tensors.

    ``tensors`` is any ``TensorSource``: ``keys()``, ``shape(name)``, ``get(name)`` and
    ``where(name)`` over the names ``transformers`` gives the checkpoint's tensors (see
    ``tfport.models.hf.loader.TensorSource``). ``origin`` starts every error message (e.g.
    ``checkpoint='dir'``). Does everything ``load_hf_model`` does after reading the directory: the
    architecture lookup, the config translation, the strict key and shape check, tied copies
    checked equal. Raises ``ValueError`` (``TypeError`` if ``hf_config`` is not a dict). With
    ``lazy``, the weights stay in ``tensors`` until read (``tfport.models.lazy``).
    """
    return loader.load(_architecture(hf_config), hf_config, tensors, origin, lazy)


def load_hf_model(path: str | os.PathLike, lazy: bool = False) -> nn.Module:
    """The tfport reference module (eval mode, ``.config`` set) of a Hugging Face checkpoint.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
    and its shards). Raises ``ValueError`` naming the file, key and shape on an unknown
    architecture, a missing, unexpected or mis-shaped tensor, or pickled weights only. With
    ``lazy``, the weights stay in the files until read (``tfport.models.lazy``).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"checkpoint={str(path)!r}: not a directory (expected {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE} from a Hugging Face save_pretrained)")
    if not (directory / CONFIG_FILE).is_file():
        raise ValueError(f"checkpoint={str(path)!r}: no {CONFIG_FILE}")
    hf = read_json(directory / CONFIG_FILE)
    arch = _architecture(hf)  # an unknown model type is said before the weights are opened
    return loader.load(arch, hf, SafetensorsTensors(directory), f"checkpoint={str(directory)!r}", lazy)


__all__ = ["is_hf_checkpoint", "hf_config_to_tfport", "load_hf_model", "load_from_tensors",
           "TensorSource", "ARCHITECTURES", "Architecture", "Rule", "Transform", "params",
           "concat_rows"]
