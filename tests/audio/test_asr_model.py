"""The speech-model contract: each family the ASR task can use is an ASRModel that says what it has."""

from __future__ import annotations

import pytest

from audio.asr import ASRTask
from audio.asr_model import ASRModel, registered_class
from audio.conformer import ConformerCTC
from audio.wav2vec2 import Wav2Vec2CTC
from audio.whisper import WhisperASR
from core.registry import MODELS

FAMILIES = {
    "conformer_ctc_xs": (ConformerCTC, False, False),
    "wav2vec2_ctc": (Wav2Vec2CTC, True, False),
    "hubert_ctc": (Wav2Vec2CTC, True, False),
    "wavlm_ctc": (Wav2Vec2CTC, True, False),
    "whisper": (WhisperASR, True, True),
}


def test_every_model_the_task_accepts_is_an_asr_model() -> None:
    for name in ASRTask.accepted("model"):
        assert issubclass(registered_class(MODELS.get(name)), ASRModel), name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_says_what_it_takes_and_has(name: str) -> None:
    cls, takes_audio, seq2seq = FAMILIES[name]
    got = registered_class(MODELS.get(name))
    assert got is cls and (got.takes_audio, got.seq2seq) == (takes_audio, seq2seq)


def test_the_joint_decoder_is_a_property_of_the_built_model() -> None:
    sizes = {"n_mels": 40, "dim": 32, "layers": 1, "heads": 2, "subsampling_channels": 8}
    plain = MODELS.build("conformer_ctc_xs", **sizes)
    joint = MODELS.build("conformer_ctc_xs", **sizes, attention_decoder_layers=1)
    assert plain.has_ctc_head and not plain.has_joint_decoder
    assert joint.has_ctc_head and joint.has_joint_decoder
