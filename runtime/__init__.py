"""Torch-free runtime: run tfport exports with ONNX Runtime and numpy.

Imports only numpy, onnxruntime, tqdm, the standard library and the tfport core (config,
contract); ``tokenizers`` is imported when a tokenizer is used.

Shape legend: B batch, S new tokens, P past length, T = P + S, H query heads, Hkv key/value
heads, D head dim, E model dim, V vocab.
"""

from .encoding import EncoderOutput, cls_pool, l2_normalize, mean_pool, pool
from .decoding import DECODINGS, DecodeStrategy, LayoutDecoding, SequenceState, choose, decoding_for
from .decoding.concat import DecodeState, decoder_forward
from .generation import FixedBatch, generate_steps
from .decoding.loop import DecodeLoop, decode_rows
from .inputs import pad_batch, positions_from_mask, split_prompts
from .model import Model, load_model
from .request import Request
from .sampling import (SamplingParams, apply_temperature, make_rng, next_token, sample, softmax,
                       top_k_filter, top_p_filter)
from .session import PROVIDERS, SessionSettings, open_session
from .tokenizer import TextTokenizer

__all__ = [
    "Model", "load_model", "Request", "SessionSettings", "PROVIDERS", "open_session",
    "SamplingParams", "make_rng", "next_token", "apply_temperature", "top_k_filter",
    "top_p_filter", "softmax", "sample",
    "DecodeState", "decoder_forward", "generate_steps", "decode_rows", "FixedBatch", "DecodeLoop", "DecodeStrategy",
    "DECODINGS", "LayoutDecoding", "decoding_for", "SequenceState", "choose",
    "EncoderOutput", "pool", "mean_pool", "cls_pool", "l2_normalize",
    "split_prompts", "pad_batch", "positions_from_mask", "TextTokenizer",
]
