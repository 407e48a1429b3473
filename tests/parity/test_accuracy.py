"""The accuracy measures of export/parity/accuracy.py: KL divergence and top-token agreement
against literal distributions, and chat answers of an export against its module's (a tiny
decoder with a word-level tokenizer and a chat template)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.export.text_models import perturbed
from tests.runtime.runtime_cases import write_tokenizer
from tests.matrix import matrix_config
from tfport.export import ExportOptions, export_model
from tfport.tools.parity import accuracy

TEMPLATE = ("{% for m in messages %}[BOS] {{ m['content'] }} [EOS] {% endfor %}"
            "{% if add_generation_prompt %}[BOS]{% endif %}")


def test_divergence_of_literal_distributions():
    """Rows of probabilities written out; KL(p || q) = sum p log(p / q) by hand. The last row
    predicts past the text and is left out, as perplexity leaves it out."""
    p = np.log(np.array([[0.5, 0.5, 1e-12], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]))
    q = np.log(np.array([[0.9, 0.1, 1e-12], [0.7, 0.2, 0.1], [0.2, 0.7, 0.1], [0.9, 0.05, 0.05]]))
    kl = [0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), 0.0,
          0.1 * math.log(0.1 / 0.2) + 0.1 * math.log(0.1 / 0.7) + 0.8 * math.log(0.8 / 0.1)]
    for chunk in (1, 2, 256):  # chunks do not change the result
        d = accuracy.divergence(p + 3.0, q - 1.0, chunk=chunk)  # logits: any offset per row
        assert d.positions == 3
        assert d.kl_mean == pytest.approx(np.mean(kl), rel=1e-9)
        assert d.kl_median == pytest.approx(np.median(kl), rel=1e-9)
        assert d.top1 == pytest.approx(2 / 3)  # row 0: both argmax 0 (ties: the first); row 2 differs
    same = accuracy.divergence(p, p)
    assert (same.kl_mean, same.top1) == (pytest.approx(0, abs=1e-12), 1.0)
    with pytest.raises(ValueError, match=r"logits of shape \(4, 2\): expected the reference's \(4, 3\)"):
        accuracy.divergence(p, q[:, :2])


def test_answers_are_cut_at_the_end_of_the_turn_and_compared_whole():
    assert accuracy.cut_answer([5, 6, 2, 7], (2,)) == (5, 6)
    assert accuracy.cut_answer(range(10, 50), (2,), limit=3) == (10, 11, 12)
    assert accuracy.answer_agreement([(1, 2), (3,), ()], [(1, 2), (3, 4), ()]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="expected 2 answers"):
        accuracy.answer_agreement([(1,), (2,)], [(1,)])


@pytest.fixture(scope="module")
def chat_exports(tmp_path_factory):
    """(module, its float32 export, another module's export), with a chat template."""
    root = tmp_path_factory.mktemp("accuracy")
    config = matrix_config("decoder", "rope", "gqa").replace(vocab_size=256, max_positions=512)
    write_tokenizer(root / "tokenizer.json", config)  # words w4 ...: the questions' words are [UNK]
    model, other = perturbed(config), perturbed(config.replace(n_decoder_layers=1))
    for name, module in (("same", model), ("other", other)):
        export_model(module, root / name, ExportOptions(tokenizer=root / "tokenizer.json", chat_template=TEMPLATE,
                                                        validate=False))
    return model, root / "same", root / "other"


def test_an_export_answers_the_chat_questions_as_its_module(chat_exports):
    """The float32 export's greedy answers through the runtime are its PyTorch module's, token for
    token; another model's export answers otherwise (the comparison can fail)."""
    model, same, other = chat_exports
    fmt = accuracy.export_chat_format(same)
    prompts = accuracy.chat_prompts(fmt)
    assert len(prompts) == len(accuracy.CHAT_QUESTIONS)
    assert all(p[0] == 1 and p[-1] == 1 for p in prompts)  # the template's [BOS] ... [BOS]
    expected = accuracy.reference_answers(model, prompts, fmt.stop_ids)
    assert all(len(a) > 0 for a in expected)
    assert accuracy.answer_agreement(expected, accuracy.export_answers(same, prompts, fmt.stop_ids)) == 1.0
    assert accuracy.answer_agreement(expected, accuracy.export_answers(other, prompts, fmt.stop_ids)) < 0.5
    # a source's template and tokenizer render the same prompts as the export's
    source = accuracy.source_chat_format(TEMPLATE, same / "tokenizer.json", model.config)
    assert accuracy.chat_prompts(source) == prompts and source.stop_ids == fmt.stop_ids
